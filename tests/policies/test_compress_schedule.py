"""The compress schedule (kvlib.engine.scheduler): where continuous batching would preempt and recompute, a running
request's cache is compacted by its policy's scores instead, and the run says which ones were."""

import pytest
from prompts import prompts_of
from serving_cases import capacity_for

from kvlib.engine import Engine
from kvlib.engine.scheduler import BATCHING, RunSettings, Sequence
from kvlib.errors import UserError
from kvlib.policies import make_policy


def tokens(result):
    return [o["token_ids"] for o in result.outputs]


def serve(tiny, schedule, name="h2o", capacity=None, **settings):
    policy = make_policy(name, budget=1.0, block_size=4, **settings)
    engine = Engine(tiny, policy, device_capacity_bytes=capacity)
    settings = RunSettings(schedule, "chunked", chunk_size=16, stop_at_eos=False)
    return engine.run([Sequence(p, 30) for p in prompts_of(40, 40, 36)], settings)


@pytest.mark.parametrize("name, settings", [("h2o", {}), ("snapkv", {"window": 8})])
def test_under_a_capacity_that_preempts_it_compresses_instead_and_lists_whom(tiny, name, settings):
    """The pool of test_serving_policies' tight capacity (about 110 tokens) makes continuous batching preempt; the
    compress schedule serves every request in full with no preemption, and the requests it never compressed end
    as they do with room to spare: what compression cost is theirs alone to whom it was applied."""
    capacity = capacity_for(tiny, 110)
    roomy = serve(tiny, "continuous", name, **settings)
    preempting = serve(tiny, "continuous", name, capacity, **settings)
    assert preempting.metrics["preemptions"] > 0
    compressing = serve(tiny, "compress", name, capacity, **settings)
    assert compressing.oom is None and compressing.metrics["preemptions"] == 0
    assert [len(t) for t in tokens(compressing)] == [30, 30, 30]
    compressions = compressing.stats["compressions"]
    assert compressions
    for c in compressions:
        assert 0 < c["entries_after"] < c["entries_before"] and c["step"] >= 0 and c["at_s"] >= 0
        assert c["needed_for"] in ("decode", "admission") and 0 <= c["generated"] <= 30
    compressed = {c["request"] for c in compressions}
    for index, (got, lossless) in enumerate(zip(tokens(compressing), tokens(roomy))):
        if index not in compressed:
            assert got == lossless
    assert compressing.metrics["preemptions"] < preempting.metrics["preemptions"]


def test_with_room_to_spare_it_is_continuous_batching(tiny):
    compressing = serve(tiny, "compress")
    assert compressing.stats["compressions"] == [] and tokens(compressing) == tokens(serve(tiny, "continuous"))
    assert compressing.stats["batching"] == BATCHING["compress"]  # the schedule it ran under, in the poster's words


def test_compress_keeps_the_share_with_the_recent_window_and_frees_blocks(tiny):
    policy = make_policy("h2o", budget=1.0, block_size=4)
    with Engine(tiny, policy).session([60], 8) as session:
        token = int(session.prefill(0, prompts_of(60)[0], "chunked", chunk_size=16).argmax())
        for _ in range(3):
            token = int(session.decode([0], [token])[0].argmax())
        used = policy.kv.pool.used
        before, after = policy.compress(0, 0.25)
        assert (before, after) == (63, 16) and policy.kv.pool.used == used - (-(-63 // 4) - 4)
        for layer in range(tiny.spec.num_layers):
            for kept in policy.kept_positions(layer, 0):
                assert len(kept) == 16 and set(range(55, 63)) <= kept  # the newest 8: H2O's recent half
        session.decode([0], [token])  # and it goes on: at budget 1.0 everything new is kept
        assert all(len(k) == 17 for k in policy.kept_positions(0, 0))


@pytest.mark.parametrize("name, settings, message", [("paged", {}, "compacts"), ("h2o", {"compress_share": 1.0},
                                                                                   "compress_share")])
def test_a_policy_that_cannot_compress_or_a_bad_share_is_one_clear_error(tiny, name, settings, message):
    policy = make_policy(name, block_size=4)
    with pytest.raises(UserError, match=message):
        Engine(tiny, policy).run([Sequence(prompts_of(20)[0], 4)], RunSettings("compress", "chunked", chunk_size=16,
                                 **settings))


def test_the_cli_serves_under_the_compress_schedule_and_lists_the_compressions(tmp_path):
    """`kvlib run --schedule compress`: a device capacity whose pool holds about 110 tokens, three requests of ~70."""
    import json
    import subprocess
    import sys

    from kvlib.models import load_model

    model = load_model("smollm2-135m")
    room = model.weights_bytes + model.packed_copy_bytes + 110 * model.spec.kv_bytes_per_token
    prompt = tmp_path / "p.txt"
    prompt.write_text(" ".join(["The cache keeps what attention reads, and the pool is small."] * 3))
    proc = subprocess.run([sys.executable, "-m", "kvlib", "run", "--policy", "h2o", "--budget", "1.0", "--set",
                           "block_size=4", "--schedule", "compress", "--compress-share", "0.5", "--prefill", "chunked",
                           "--chunk-size", "16", "--batch-size", "3", "--max-new-tokens", "30", "--ignore-eos",
                           "--device-capacity-gb", f"{room / 0.9 / 2**30 + 1e-6:.9f}", "--prompt-file", str(prompt),
                           "--json"], capture_output=True, text=True, check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert [len(o["token_ids"]) for o in out["outputs"]] == [30, 30, 30] and out["metrics"]["preemptions"] == 0
    assert out["policy_stats"]["compressions"]


def test_the_compress_contract_is_declared_on_every_policy_with_defaults():
    """What the compress schedule reads of a policy is declared in the contract (KVPolicy), not looked up by name:
    whether it can compress, the share a compressed request keeps and whether it compresses to admit, with defaults
    that compress_h2o's own settings replace (and only its settings name them, so a run records them for it alone)."""
    paged, h2o, mine = make_policy("paged"), make_policy("h2o"), make_policy("compress_h2o", compress_share=0.25,
                                                                             compress_to_admit=True)
    assert not paged.can_compress and h2o.can_compress and mine.can_compress
    assert (h2o.compress_share, h2o.compress_to_admit) == (0.5, False)
    assert (mine.compress_share, mine.compress_to_admit) == (0.25, True)
    assert "compress_share" not in h2o.settings() and mine.settings()["compress_share"] == 0.25
