"""One error rate per page (kvlib.report.pages): the findings page's tested statements, simulated under a truth where
every policy is the full cache and every runner equally fast (an A/A of the whole page), are wrong together in at most
5 % of pages; the weights are declared, so a chapter that reads a finding's claims reads the same objects."""

import numpy as np
import pandas as pd
import pytest

from kvlib.report import stats
from kvlib.report.accuracy.paper_beside import accuracy_claims
from kvlib.report.findings.verdicts import throughput_claims
from kvlib.report.pages import ACCURACY, FINDINGS
from kvlib.report.retention import claims as retention_claims
from kvlib.report.stats import CONFIRMED, REFUTED

CHANCE = {"piqa": 0.5, "copa": 0.5, "winogrande": 0.5, "hellaswag": 0.25, "openbookqa": 0.25, "boolq": 0.62}

# under the A/A truth (every drop 0, every ratio 1), which verdict would be wrong for each claim
WRONG = {
    "h2o at budget 0.5 near the full cache": REFUTED,
    "infinigen at budget 0.5 near the full cache": REFUTED,
    "infinigen at budget 0.1 loses ~6 pp": CONFIRMED,
    "H2O loses more than InfiniGen": CONFIRMED,
    "h2o at a 2-4 % budget approaches random guessing": CONFIRMED,  # it answers as the full cache: above chance
    "infinigen at a 2-4 % budget approaches random guessing": CONFIRMED,
    "h2o at budget 0.3 within 10 pp on most tasks": REFUTED,
    "infinigen at budget 0.3 within 10 pp on most tasks": REFUTED,
    "infinigen within +-5 pp": REFUTED,
    "h2o 17-27 pp lower": CONFIRMED,
    "h2o worse with longer contexts": CONFIRMED,
    "h2o's decode throughput within": REFUTED,
    "vllm faster than infinigen": CONFIRMED,
    "vllm / infinigen an order of magnitude": CONFIRMED,
    "h2o's throughput per GB ~3x": REFUTED,  # vLLM books 3x H2O's device memory (aa_page): per GB, 3x is the truth
    "vllm's TTFT below": CONFIRMED,
}


def wrong(name: str, verdict: str) -> bool:
    return any(name.startswith(claim) and verdict == word for claim, word in WRONG.items())


def aa_page(rng, items=240, conversations=60, repeats=10):
    """One page's rows under the A/A truth: every policy answers as the full cache does, by the same chance and
    independently; every runner's timings drawn alike, vLLM booking 3x the device memory of the others (so that
    ~3x per GB and "similar throughput" can both hold, and the per-GB claim is tested: kvlib.report.findings.verdicts)."""
    def answers():  # `items` over the paper's six tasks
        return (rng.random(items // len(CHANCE)) < 0.85).astype(float)

    points = [("full", None)] + [(p, b) for p in ("h2o", "infinigen") for b in (0.5, 0.3, 0.1, 0.04)]
    accuracy = pd.DataFrame([{"model": "m", "task": t, "protocol": "one_pass", "chance": chance, "doc_id": i,
                              "policy": p, "budget": b, "budget_rule": "flexgen" if p == "h2o" else None,
                              "alpha": 5.0 if p == "infinigen" else None, "correct": c}
                             for t, chance in CHANCE.items() for p, b in points
                             for i, c in enumerate(answers())])
    retention = pd.DataFrame([{"policy": p, "budget": None if p == "full" else 0.3, "bucket": b, "conversation": f"c{c}",
                               "turn": t, "correct": bool(rng.random() < 0.9), "protocol": "deployed"}
                              for c in range(conversations) for b in (("1K-2K", "2K-4K")[c % 2],)
                              for t in (2, 12) for p in ("full", "h2o", "infinigen")])
    # timings as the executor records them: one run of every point a round (`repeat`), the round's machine speed
    # shared by its runs, so that the page reads them with the by-round test, as the book does
    drift = np.exp(0.1 * rng.standard_normal(repeats))
    batch = pd.DataFrame([{"policy": p, "outside": p == "vllm", "batch_size": size, "oom": False, "repeat": r,
                           "decode_tokens_per_s": 50 * drift[r] * np.exp(0.05 * rng.standard_normal()),
                           "ttft_s": 0.1 / drift[r] * np.exp(0.05 * rng.standard_normal()),
                           "device_peak_bytes": 2**30 * (3 if p == "vllm" else 1)}
                          for p in ("vllm", "h2o", "infinigen") for size in (1, 16) for r in range(repeats)])
    return accuracy, retention, batch


def page_statements(accuracy, retention, batch):
    """Every tested statement of the findings page: (claim, verdict)."""
    timing = throughput_claims(batch).claims
    assert all(c.paired for c in timing)  # the by-round test, not the two-sample one
    out = list(zip([c.name for c in timing], stats.settle(timing, FINDINGS.share("finding 2"))))
    for claims in (accuracy_claims(accuracy, 0.7), retention_claims(retention, 0.7)):
        out += [(c.name, c.verdict) for c in claims.claims]
    return out


def test_the_findings_page_is_wrong_together_in_at_most_5_percent_of_a_a_pages():
    rng = np.random.default_rng(11)
    pages, wrong_pages, settled = 120, 0, 0
    for _ in range(pages):
        statements = page_statements(*aa_page(rng))
        assert len(statements) == FINDINGS.total  # every declared claim (the rows name no CPU: the bus claim too)
        wrong_pages += any(wrong(name, verdict) for name, verdict in statements)
        settled += sum(verdict != stats.INCONCLUSIVE for _, verdict in statements)
    assert wrong_pages / pages <= 0.05, wrong_pages
    assert settled > pages  # the page says something: true statements are confirmed or refuted along the way


def test_an_unadjusted_page_would_be_wrong_more_often():
    """The same simulation with every statement at 5 % on its own (no page family) is wrong more often: the test
    above can fail."""
    rng = np.random.default_rng(11)
    wrong_pages = 0
    for _ in range(60):
        accuracy, retention, batch = aa_page(rng, items=120, conversations=30)
        timing = throughput_claims(batch).claims
        statements = list(zip([c.name for c in timing], stats.settle(timing, 0.05 * len(timing))))
        for claims in (accuracy_claims(accuracy, 0.7, level=0.95), retention_claims(retention, 0.7, level=0.95)):
            statements += [(c.name, c.verdict) for c in claims.claims]
        wrong_pages += any(wrong(name, verdict) for name, verdict in statements)
    assert wrong_pages / 60 > 0.05, wrong_pages


def test_the_weights_are_declared_and_spend_alpha_exactly():
    assert sum(FINDINGS.share(name) for name, _ in FINDINGS.weights) == pytest.approx(stats.ALPHA)
    assert FINDINGS.level("finding 4", 8) == FINDINGS.level("finding 5", 3) == 1 - stats.ALPHA / 17
    assert sum(ACCURACY.share(name) for name, _ in ACCURACY.weights) == pytest.approx(stats.ALPHA)
    assert "at most 5%" in FINDINGS.statement() and "finding 2 1.76%" in FINDINGS.statement()
