"""The paper's findings in its own words, as each chapter quotes them beside ours: one claim a chapter."""

TTFT = ("full-matrix prefill (needed by H2O's scores) runs out of memory at ~10K tokens on an 80 GB H100; fused "
        "attention rescues InfiniGen, chunked prefill rescues H2O.")
BATCH_SCALING = ("vLLM has the highest throughput; H2O matches it with far less device memory (~3x throughput per GB); "
                 "InfiniGen is an order of magnitude slower; InfiniGen's host memory grows with batch.")
DECODE_LENGTH = ("throughput stays roughly flat with output length for vLLM and H2O; InfiniGen's per-step transfers "
                 "keep it far below.")
ACCURACY = ("at budget 0.5 both sparse methods are near the full cache; at 0.1 InfiniGen loses ~6 pp on average and "
            "H2O more (HellaSwag -23 pp, BoolQ -16 pp); at 2-4 % both approach chance.")
RETENTION = ("the full cache retains the fact 94-96 % of the time, InfiniGen within 1-4 pp of it, H2O 17-27 pp lower "
             "and worse with longer contexts.")
