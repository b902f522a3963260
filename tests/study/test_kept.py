"""What a computing process keeps between points (kvlib.study.kept): models loaded once, and never another model
beside an accuracy prefill store, which a worker's memory was sized to hold beside one model: neither kept while the
store fills nor loaded while another model's store is held."""

import types

from kvlib.engine.prefill_record import PrefillStore
from kvlib.study import kept as kept_module
from kvlib.study.experiments.accuracy import model_and_store


def point(model: str, store_gb: float = 1.0):
    return types.SimpleNamespace(experiment="accuracy", model=model, device=None, weights="pretrained",
                                 values={"prefill_store_gb": store_gb})


def test_a_prefill_store_keeps_its_model_alone(monkeypatch):
    process = kept_module.Kept()
    loads = []  # (the model loaded, the model whose store was held as it loaded)

    def load_model(name, device=None, weights="pretrained"):
        held = process.once.get(PrefillStore)
        loads.append((name, held[0][0] if held else None))
        return types.SimpleNamespace(name=name)

    monkeypatch.setattr(kept_module, "load_model", load_model)
    large = process.model("qwen2.5-coder-1.5b")
    assert process.model("qwen2.5-coder-1.5b") is large  # loaded once
    small = process.model("smollm2-135m")
    assert len(process.models) == 2  # two kept between points of no store
    loaded, store = model_and_store(point("smollm2-135m"), process)
    assert loaded is small and [m.name for m in process.models.values()] == ["smollm2-135m"]
    assert model_and_store(point("smollm2-135m"), process)[1] is store  # the same model's points share it
    loaded, other = model_and_store(point("qwen2.5-coder-1.5b"), process)
    assert other is not store and [m.name for m in process.models.values()] == ["qwen2.5-coder-1.5b"]
    # the 1.5B model loaded again after SmolLM2's store was dropped, never beside it
    assert loads[-1] == ("qwen2.5-coder-1.5b", None), loads
    assert model_and_store(point("qwen2.5-coder-1.5b", 2.0), process)[1] is not other  # another size: a fresh store


def test_a_process_holds_nothing_while_its_workers_compute(monkeypatch):
    """The study's process waits while worker processes compute an untimed experiment's units, each counted the
    machine's whole memory: a store and model it kept from its own units (the 1.5B model, SmolLM2's 16 GB store)
    would sit beside them."""
    from kvlib.study import executor

    process = kept_module.Kept()
    monkeypatch.setattr(kept_module, "load_model", lambda name, device=None, weights="pretrained":
                        types.SimpleNamespace(name=name))
    model_and_store(point("smollm2-135m"), process)
    monkeypatch.setattr(executor, "_kept", process)
    executor.Processes(2).run([], {}, lambda *args: None)
    assert not process.models and not process.once
