"""The paper's findings in its own words, as the book quotes them beside ours."""

PAPER = {
    "ttft": "full-matrix prefill (needed by H2O's scores) runs out of memory at ~10K tokens on an 80 GB H100; fused "
            "attention rescues InfiniGen, chunked prefill rescues H2O.",
    "batch_scaling": "vLLM has the highest throughput; H2O matches it with far less device memory (~3x throughput "
                     "per GB); InfiniGen is an order of magnitude slower; InfiniGen's host memory grows with batch.",
    "decode_length": "throughput stays roughly flat with output length for vLLM and H2O; InfiniGen's per-step "
                     "transfers keep it far below.",
    "accuracy": "at budget 0.5 both sparse methods are near the full cache; at 0.1 InfiniGen loses ~6 pp on average "
                "and H2O more (HellaSwag -23 pp, BoolQ -16 pp); at 2-4 % both approach chance.",
    "retention": "the full cache retains the fact 94-96 % of the time, InfiniGen within 1-4 pp of it, H2O 17-27 pp "
                 "lower and worse with longer contexts.",
}
