"""What the frontier places a policy at (kvlib.report.accuracy.frontier): the device bytes its cache held per token seen, as
each decode step books them (KVUsage.held, from Session.decode). A row's slots serve every layer and KV head, so a
policy whose heads or layers keep different counts (Ada-KV, PyramidKV) holds every head as wide as its widest: that
padding is device memory the row holds, booked as `kv` and counted (issue 53, item 13), not left in `kv_reserved`."""

import pytest
import torch

from kvlib.engine import Engine
from kvlib.policies import make_policy


@pytest.mark.parametrize("name, settings", [("full", {}), ("snapkv", {"budget": 0.3, "window": 8}),
                                            ("adakv", {"budget": 0.3, "window": 8}),
                                            ("pyramidkv", {"budget": 0.3})])
def test_the_bytes_held_are_the_slots_the_rows_occupy(tiny, name, settings):
    torch.manual_seed(1)
    prompt = torch.randint(100, 5000, (120,)).tolist()
    policy = make_policy(name, **settings)
    engine = Engine(tiny, policy)
    with engine.session([120], 4) as session:
        token = int(session.prefill(0, prompt, "chunked", chunk_size=32).argmax())
        session.decode([0], [token])
        kv = engine.ledger.current[("device", "kv")]
        assert policy.usage.held_bytes == kv
        if name in ("adakv", "pyramidkv"):  # the widest (layer, head) for every one, above the entries it keeps
            entries = policy.kept[0] * tiny.spec.num_layers * tiny.spec.num_kv_heads + policy.delta[:, 0].sum()
            widest = policy.kept[0] + policy.delta[:, 0].max()
            per_entry = tiny.spec.kv_bytes_per_token // (tiny.spec.num_layers * tiny.spec.num_kv_heads)
            assert kv == int(widest) * tiny.spec.kv_bytes_per_token > int(entries) * per_entry
