"""Quest's block selection in C (kvlib.kernels.cpu_kernel.quest_select) against the PyTorch path it replaces on a CPU
(QuestPolicy.select_blocks + selected_blocks): the same block lists and lengths over random layouts, the same rule
for equal bounds, and its refusals of what it cannot read."""

import random

import pytest
import torch
from selection_cases import quest_case

from kvlib.kernels import cpu_kernel
from kvlib.models.loading import ModelSpec
from kvlib.policies import make_policy

needs_kernel = pytest.mark.skipif(not cpu_kernel.available(), reason="no C compiler: the kernel is not built")


def pytorch_selection(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """QuestPolicy's PyTorch path on this case (the policy's state set as prepare sets it)."""
    query, kv_heads = case["query"], case["key_min"].shape[1]
    policy = make_policy("quest", block_size=case["block_size"])
    policy.spec = ModelSpec("case", 1, query.shape[1], kv_heads, query.shape[-1], 0, 0, torch.float32)
    policy.device = torch.device("cpu")
    policy.table, policy.row_blocks, policy.pages, policy.seen = (case[k] for k in ("table", "row_blocks", "pages",
                                                                                    "seen"))
    return policy.selected_blocks(policy.select_blocks(query, case["table"], case["key_min"], case["key_max"]))


@needs_kernel
@pytest.mark.parametrize("seed", range(4))
def test_the_c_selection_equals_the_pytorch_path(seed):
    rng = random.Random(seed)
    for i in range(40):
        case = quest_case(rng)
        want_table, want_lengths = pytorch_selection(case)
        table, lengths = cpu_kernel.quest_select(**case)
        assert torch.equal(lengths, want_lengths), (seed, i)
        assert torch.equal(table, want_table), (seed, i)


def chosen_positions(case, table, lengths) -> list[list[list[int]]]:
    """Each (row, KV head)'s chosen blocks as positions in its row's table, in the order listed."""
    bs = case["block_size"]
    return [[[case["table"][b].tolist().index(x) for x in table[b, h, :-(-int(lengths[b, h]) // bs)].tolist()]
             for h in range(table.shape[1])] for b in range(table.shape[0])]


@needs_kernel
def test_equal_bounds_go_to_the_earlier_block_on_both_paths():
    rng = random.Random(5)
    for i in range(40):
        case = quest_case(rng, ties=True)
        got = cpu_kernel.quest_select(**case)
        want = pytorch_selection(case)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), i
        if not case["query"].any() or not (case["key_max"].any() or case["key_min"].any()):  # every bound (-)0:
            # the first blocks, and the last
            for b, heads in enumerate(chosen_positions(case, *got)):
                n, p = int(case["row_blocks"][b]), int(case["pages"][b])
                first = list(range(min(p, n) - 1))
                assert all(h == first + [n - 1] for h in heads), (i, b, heads)


@needs_kernel
def test_the_row_s_last_block_is_always_read_and_padding_stays_in_the_pool():
    rng = random.Random(6)
    for _ in range(30):
        case = quest_case(rng)
        table, lengths = cpu_kernel.quest_select(**case)
        for b, heads in enumerate(chosen_positions(case, table, lengths)):
            n = int(case["row_blocks"][b])
            for h, positions in enumerate(heads):
                assert positions[-1] == n - 1 and positions == sorted(set(positions))
                assert len(positions) == min(n, int(case["pages"][b]))
                assert int(lengths[b, h]) == (len(positions) - 1) * case["block_size"] + int(case["seen"][b]) \
                    - (n - 1) * case["block_size"]
        assert int(table.min()) >= 0 and int(table.max()) < case["key_min"].shape[0]


def base_case() -> dict:
    """A case of 2 or more KV heads whose block lists are 2 or more blocks wide (what the changes below break)."""
    rng = random.Random(11)
    while True:
        case = quest_case(rng)
        if case["key_min"].shape[1] >= 2 and case["width"] >= 2:
            return case


@needs_kernel
@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(key_max=c["key_max"][:, :, :-1].contiguous()), "key_max must have shape"),
    (lambda c: c.update(query=c["query"].double()), "query must be torch.float32"),
    (lambda c: c.update(key_min=c["key_min"].transpose(0, 1).contiguous().transpose(0, 1)), "key_min must be contiguous"),
    (lambda c: c.update(table=c["table"].int()), "table must be torch.int64"),
    (lambda c: c.update(table=c["table"].t().contiguous().t()), "table must be contiguous"),
    (lambda c: c.update(seen=c["seen"][:-1]), "seen must have shape"),
    (lambda c: c.update(query=c["query"][:, :1].contiguous()), "heads must be a multiple"),
    (lambda c: c.update(key_min=c["key_min"][0]), "key_min must have shape"),
    (lambda c: c.update(query=c["query"][..., :40].contiguous(), key_min=c["key_min"][..., :40].contiguous(),
                        key_max=c["key_max"][..., :40].contiguous()), "head dim must be a multiple"),
    (lambda c: c.update(width=0), "width must be in"),
    (lambda c: c.update(width=c["width"] - 1), "out of range"),
    (lambda c: c["row_blocks"].__setitem__(0, c["table"].shape[1] + 1), "out of range"),
    (lambda c: c["row_blocks"].__setitem__(0, 0), "out of range"),
    (lambda c: c["pages"].__setitem__(0, 0), "out of range"),
    (lambda c: c["seen"].__setitem__(0, int(c["row_blocks"][0]) * c["block_size"] + 1), "out of range"),
    (lambda c: c["seen"].__setitem__(0, (int(c["row_blocks"][0]) - 1) * c["block_size"]), "out of range"),
    (lambda c: c["table"].__setitem__((0, 0), c["key_min"].shape[0]), "outside the pool"),
    (lambda c: c["table"].__setitem__((0, 0), -1), "outside the pool"),
    (lambda c: c["table"].__setitem__((0, -1), c["key_min"].shape[0] + 7), "outside the pool"),  # the padding
])
def test_the_c_selection_refuses_what_it_cannot_read(change, message):
    case = base_case()
    case["table"] = torch.cat([case["table"], torch.zeros_like(case["table"][:, :1])], dim=1)  # a padding column
    cpu_kernel.quest_select(**case)  # as built, it runs
    change(case)
    with pytest.raises(ValueError, match=message):
        cpu_kernel.quest_select(**case)
