"""tilertc: an ahead-of-time compiler from an LLM architecture to one persistent CUDA kernel."""

__version__ = "0.1.0"

from tilertc.driver import CompileOptions, compile  # noqa: E402
from tilertc.engine import Engine  # noqa: E402
from tilertc.ir.build import build_graph  # noqa: E402
from tilertc.ir.reference import Reference  # noqa: E402
from tilertc.model_specs import load_spec  # noqa: E402
from tilertc.model_specs.spec import ModelSpec, SpecError  # noqa: E402
from tilertc.passes.pipeline import make_program as schedule  # noqa: E402

__all__ = ["CompileOptions", "Engine", "ModelSpec", "Reference", "SpecError", "build_graph",
           "compile", "load_spec", "schedule", "__version__"]
