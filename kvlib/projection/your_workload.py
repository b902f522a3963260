"""One workload of the user's, projected onto one machine (`kvlib choose --hardware`): the paper's runners
(kvlib.projection.paper_scale) and every other runner of the profile's systems experiments, each step read from its
policy (kvlib.projection.policy_step); every figure labelled projected or bound, none ranked."""

from __future__ import annotations

from kvlib.projection.paper_scale import Runner, Workload, measured, projection, runners


def for_workload(model: str, hardware_name: str, prompt: int, batch: int, output: int, profile: str = "embedded",
                 systems: list[tuple[str, str, dict]] = ()):
    """One workload of `model` on one machine, every runner projected (`kvlib choose --hardware`): where no
    measurement of that model on that machine exists. The paper's runners (`runners`), then every other runner of
    the profile's systems experiments (`systems`: kvlib.study.profile.Profile.systems_runners), its step read from
    its policy (kvlib.projection.policy_step); a runner that cannot be projected keeps a row that says why."""
    from kvlib.projection import gpu_kernels

    return projection(profile=profile, hardware_names=(hardware_name,), kernels=gpu_kernels.available(), model=model,
                      loads=[Workload("your workload", batch, prompt, output)], runner_list=workload_runners(profile, systems))


def workload_runners(profile: str = "embedded", systems: list[tuple[str, str, dict]] = ()) -> list[Runner]:
    """`runners` (InfiniGen at its measured share, or a row saying none was measured) and every other runner of
    `profile`'s systems experiments at its settings there (`systems`: (label, policy, settings) each)."""
    share, source, _ = measured(profile)
    out = runners(profile=profile)
    if share is None:
        out.insert(3, Runner("infinigen (measured share)", "infinigen", reason=source))
    paper = {r.policy for r in out}
    for label, policy, settings in systems:
        if policy not in paper:
            out.append(Runner(label, policy, settings=tuple(sorted(settings.items()))))
    return out


def workload_text(table, device_limit_gb: float | None = None, rulings: dict[str, str] | None = None) -> str:
    """The projection of one workload in words, runner by runner, each figure labelled; no runner ranked (nothing
    here is measured, so nothing is tested). device_limit_gb: the device memory the user allows, below the
    machine's; rulings: what the measured answer said of a runner's accuracy, beside its projection."""
    first = table.iloc[0]
    head = (f"Projected on {first.hardware} ({first.hardware_spec}) at batch {first.batch_size}, "
            f"{first.prompt_tokens:,}-token prompts, {first.output_tokens:,} new tokens: no measurement exists there; "
            f"a bound is the most decode throughput the counted work allows on its datasheet figures"
            + (f", aiconfigurator's an estimate from NVIDIA's measured kernels "
               f"({table.kernel_data_version.dropna().iloc[0]})" if "decode_tokens_per_s_projected" in table else "")
            + ".")
    lines = [head]
    for _, r in table.iterrows():
        reason = r.get("not_projected")
        if isinstance(reason, str):
            lines.append(f"- {r.runner}: not projected: {reason}")
            continue
        estimate = (f", ~{r.decode_tokens_per_s_projected:,.0f} (aiconfigurator)"
                    if "decode_tokens_per_s_projected" in table and r.decode_tokens_per_s_projected == r.decode_tokens_per_s_projected
                    else "")
        fits = "fits" if r.fits_device_projected else "does not fit"
        if device_limit_gb is not None and r.device_gb_projected > device_limit_gb:
            fits = f"over your {device_limit_gb:g} GB"
        ruling = (rulings or {}).get(r.runner) or (rulings or {}).get(r.runner.split(" ")[0])
        lines.append(f"- {r.runner}: at most {r.decode_tokens_per_s_bound_projected:,.0f} tokens/s (bound){estimate}; "
                     f"device {r.device_gb_projected:.1f} GB ({fits}), host {r.host_gb_projected:.1f} GB (projected)"
                     + (f"; accuracy: {ruling}" if ruling else "")
                     + (f"; {r.note}" if isinstance(r.get("note"), str) else ""))
    return "\n".join(lines)
