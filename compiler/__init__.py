"""tilertc: an ahead-of-time compiler from an LLM architecture to one persistent CUDA kernel."""

from tilertc.ir.build import build_graph
from tilertc.ir.reference import Reference
from tilertc.model_specs import load_spec
from tilertc.model_specs.spec import ModelSpec, SpecError

__version__ = "0.1.0"
__all__ = ["ModelSpec", "Reference", "SpecError", "build_graph", "load_spec", "__version__"]
