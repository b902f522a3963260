"""The settings registry-wide tests run a policy at, read from the policy itself (`small_example`,
`keeps_all_example` on kvlib.policies.base.KVPolicy), and what the tests derive from its declaration: a policy added
to the registry brings its own, so adding one is one file."""

from kvlib.policies import REGISTRY, policy_settings


def example(name: str, which: str = "small", **where_it_has) -> dict:
    """The policy's `small` or `keeps_all` example, with each of the test's own choices (block_size=4,
    percent=kvlib.policies.flexgen.ALL_ON_DEVICE) applied where the policy has that setting."""
    cls = REGISTRY[name]
    settings = dict(cls.small_example if which == "small" else cls.keeps_all_example)
    own = set(policy_settings(name))
    return {**settings, **{k: v for k, v in where_it_has.items() if k in own}}


def reserves_rows(name: str) -> bool:
    """It reserves each row's whole length up front (no blocks): it serves as many rows as the capacity holds."""
    return "block_size" not in policy_settings(name)


def whole_prompt(name: str) -> bool:
    """It scores a prompt in one pass (H2O in FlexGen: the prompt's attention matrix): continuous batching prefills
    in chunks, so it serves statically only."""
    return "chunked" not in REGISTRY[name].supported_prefill
