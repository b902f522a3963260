"""A policy's settings from the command line (`--budget`, `--set key=value`, FlexGen's placement), shared by `run` and
`eval`."""

from __future__ import annotations

from kvlib.errors import UserError

# the policies that place their cache across device, host and disk (FlexGen's settings)
PLACED_POLICIES = ("flexgen", "flexgen_h2o")


def add_placement_arguments(parser) -> None:
    parser.add_argument("--percent", type=float, nargs=6, default=None,
                        metavar=("W_DEV", "W_HOST", "KV_DEV", "KV_HOST", "ACT_DEV", "ACT_HOST"),
                        help="FlexGen's placement: percent of the weights, the KV cache and the activations on the "
                             "device and the host, the disk taking the rest (policies flexgen, flexgen_h2o)")
    parser.add_argument("--offload-dir", default=None,
                        help="folder for the disk tier's files (default: kvlib's cache folder, offload/)")
    parser.add_argument("--compress-cache", action="store_true",
                        help="keep the KV cache in 4 bits (groups of 64 along the head dim, FlexGen's format)")
    parser.add_argument("--gpu-batch-size", type=int, default=None,
                        help="rows of a micro-batch (FlexGen's GPU batch): each layer runs on each micro-batch of the "
                             "batch in turn, its weights loaded once for all of them (default: the batch is one)")


def _setting_value(text: str):
    """Policy settings from `--set key=value`: numbers, booleans and None parsed, anything else a string."""
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def settings_from_args(args) -> dict:
    from kvlib.policies import REGISTRY, policy_settings

    settings = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise UserError(f"--set needs KEY=VALUE, got {item!r}")
        settings[key.replace("-", "_")] = _setting_value(value)
    if args.budget is not None:
        settings["budget"] = args.budget
    share = getattr(args, "compress_share", None)
    if share is not None and args.policy in REGISTRY and "compress_share" in policy_settings(args.policy):
        settings["compress_share"] = share  # one value: the policy's own setting is the share the schedule uses
    placement = {k: v for k, v in (("percent", args.percent), ("offload_dir", args.offload_dir),
                                   ("compress_cache", args.compress_cache or None),
                                   ("gpu_batch_size", args.gpu_batch_size)) if v is not None}
    if placement and args.policy not in PLACED_POLICIES:
        flags = ", ".join(f"--{k.replace('_', '-')}" for k in placement)
        raise UserError(f"{flags}: placing the KV cache across device, host and disk is supported by policies "
                        f"{' and '.join(PLACED_POLICIES)} (FlexGen: the full cache; FlexGen + H2O), not by policy "
                        f"{args.policy!r}")
    if "percent" in placement:
        placement["percent"] = " ".join(f"{v:g}" for v in placement["percent"])
    return {**settings, **placement}
