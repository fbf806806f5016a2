"""TileLang is an optional, pinned dependency: load it, or say how to install it.

Pinned, because the composition relies on the shape of the CUDA source that TileLang's lowering
emits (one `extern "C" __global__` per tile, thread index as `threadIdx.x`), which other
releases may change. TVM is used only through the copy bundled with TileLang.
"""

from __future__ import annotations

from types import ModuleType

TILELANG_VERSION = "0.1.15"
INSTALL_HINT = 'pip install "tilertc[tilelang]"'


class TileLangMissing(RuntimeError):
    """`--backend tilelang` where TileLang (the pinned release) cannot be imported."""


def load_tilelang() -> ModuleType:
    """The `tilelang` module of the pinned release, or TileLangMissing naming the install."""
    try:
        import tilelang
    except (ImportError, OSError) as e:
        raise TileLangMissing(
            f"--backend tilelang needs TileLang {TILELANG_VERSION}, which cannot be imported "
            f"here ({e}); install it with: {INSTALL_HINT}"
        ) from None
    found = str(getattr(tilelang, "__version__", "unknown")).split("+")[0]
    if found != TILELANG_VERSION:
        raise TileLangMissing(
            f"--backend tilelang is pinned to TileLang {TILELANG_VERSION}, found {found}; "
            f"install the pinned release with: {INSTALL_HINT}"
        )
    return tilelang
