"""A model for the engine: loading (hub, local path or the embedded GGUF), kvlib's own forward pass for the Llama
family, random weights for the paper's architectures, and the prompt sources the engine and the study draw on."""

from kvlib.models.loading import WEIGHTS, LoadedModel, ModelSpec, load_model, model_config, resolve_model_path

__all__ = ["WEIGHTS", "LoadedModel", "ModelSpec", "load_model", "model_config", "resolve_model_path"]
