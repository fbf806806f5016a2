"""Model descriptions: the typed `ModelSpec`, built-in specs and the HF config frontend."""

from tilertc.model_specs.hf import spec_from_hf_config
from tilertc.model_specs.load import builtin_names, load_spec
from tilertc.model_specs.spec import ModelSpec, SpecError
from tilertc.model_specs.validate import validate

__all__ = ["ModelSpec", "SpecError", "builtin_names", "load_spec", "spec_from_hf_config",
           "validate"]
