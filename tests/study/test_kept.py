"""What a computing process keeps between points (kvlib.study.kept): models loaded once, and never another model
beside an accuracy prefill store, which a worker's memory was sized to hold beside one model."""

import types

from kvlib.study import kept as kept_module
from kvlib.study.experiments.accuracy import prefill_store


class Model:  # weakref-able, as a torch module is
    pass


def test_a_prefill_store_keeps_its_model_alone(monkeypatch):
    monkeypatch.setattr(kept_module, "load_model",
                        lambda name, device=None, weights="pretrained": types.SimpleNamespace(name=name, model=Model()))
    process = kept_module.Kept()
    large = process.model("qwen2.5-coder-1.5b")
    assert process.model("qwen2.5-coder-1.5b") is large  # loaded once
    small = process.model("smollm2-135m")
    assert len(process.models) == 2  # two kept between points of no store
    store = prefill_store(process, small, 1.0)
    assert [m.name for m in process.models.values()] == ["smollm2-135m"]
    assert prefill_store(process, small, 1.0) is store  # the same model's points share it
    other = prefill_store(process, process.model("qwen2.5-coder-1.5b"), 1.0)
    assert other is not store and [m.name for m in process.models.values()] == ["qwen2.5-coder-1.5b"]
