"""Every registered policy against the full cache on one long prompt: KV bytes held at the end, the decode step's
median latency, and what the policy attended or read. Budgeted policies at 0.3, KIVI at its default bits.

Each policy runs in its own process (as benchmarks/bench_decode.py runs each engine), in alternating order over
rounds; the decode step is the median of a run's steps, and the figure is the median over rounds.
Writes benchmarks/results/policies.json.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

from smoke import SMOKE, results_path, sized

OUT = results_path("policies.json")
PROMPT_TOKENS = sized(4096, 256)
NEW_TOKENS = sized(17, 3)
ROUNDS = sized(2, 1)
BUDGET = 0.3


def one_run(policy: str) -> dict:
    from kvlib.engine import Engine
    from kvlib.models import load_model
    from kvlib.models.workloads import prompt_of_length
    from kvlib.policies import make_policy, policy_settings

    model = load_model("smollm2-135m", device="cpu")
    settings = {"budget": BUDGET} if "budget" in policy_settings(policy) else {}
    chosen = make_policy(policy, **settings)
    prompt = prompt_of_length(model.tokenizer, PROMPT_TOKENS)
    result = Engine(model, chosen).generate([prompt], NEW_TOKENS, prefill_mode=chosen.preferred_prefill,
                                            stop_at_eos=False)
    device = result.memory["device"]
    return {"policy": policy, "settings": chosen.settings(), "kv_bytes": device["kv_bytes"],
            "kv_bytes_host": result.memory.get("host", {}).get("kv_bytes"),
            "decode_step_s": statistics.median(result.metrics["step_latencies_s"]),
            "kv_share_attended": result.stats.get("kv_share_attended"),
            "kv_read_share": result.stats.get("kv_read_share")}


def main() -> None:
    from kvlib.policies import available

    policies = available()
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    for round_ in range(ROUNDS):
        order = policies if round_ % 2 == 0 else policies[::-1]
        for policy in order:
            out = subprocess.run([sys.executable, __file__, policy], capture_output=True, text=True, check=True)
            runs[policy].append(json.loads(out.stdout.strip().splitlines()[-1]))
    full = statistics.median(r["decode_step_s"] for r in runs["full"])
    full_kv = runs["full"][0]["kv_bytes"]
    table = []
    for policy, rs in runs.items():
        step = statistics.median(r["decode_step_s"] for r in rs)
        table.append({**rs[0], "decode_step_s": step, "decode_step_s_rounds": [r["decode_step_s"] for r in rs],
                      "decode_step_vs_full": step / full, "kv_bytes_vs_full": rs[0]["kv_bytes"] / full_kv})
        print(f"{policy:10s} KV {rs[0]['kv_bytes'] / 2**20:8.1f} MiB ({rs[0]['kv_bytes'] / full_kv:.2f}x full)  "
              f"decode step {step * 1e3:6.1f} ms ({step / full:.2f}x full)")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS, "rounds": ROUNDS,
                               "budget": BUDGET, "smoke": SMOKE, "policies": table}, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(json.dumps(one_run(sys.argv[1])))
    else:
        main()
