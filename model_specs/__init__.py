"""Model descriptions: the typed `ModelSpec`, built-in specs and the Hugging Face config frontend."""

from tilertc.model_specs.hf import spec_from_hf_config
from tilertc.model_specs.spec import ModelSpec, SpecError


def load_spec(name_or_path, overrides=None) -> ModelSpec:  # replaced by the full frontend
    import json

    with open(name_or_path) as f:
        cfg = json.load(f)
    cfg.update(overrides or {})
    return spec_from_hf_config(cfg, source=str(name_or_path))


__all__ = ["ModelSpec", "SpecError", "load_spec", "spec_from_hf_config"]
