"""The tile TileLang generates, and its lowering to CUDA source on a machine without a GPU.

The tile is one warp's share of a matrix-vector task: a segment of one bf16 weight row (in a
ring page in shared memory) times the same segment of the staged fp32 input vector, accumulated
in fp32 and reduced over the warp. It is written as a TileLang tile program (a fragment
accumulator over `T.Parallel` blocks, `T.reduce_sum`), so TileLang picks the thread layout,
the vector width of the loads and the reduction; the skeleton decides which warp runs which
segment when (segments.py). Blocks are a power of two of at most 256 elements (32 lanes x 8),
the last one masked: TileLang 0.1.15 refuses a fragment whose extent does not tile the warp
("iterations do not traverse full iter space", e.g. 40 elements), and silently computed only
part of the product when one fragment was filled by two `T.Parallel` loops of different
extents (a 256-element main block and a 32-element tail), so neither form is used.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

WARP_THREADS = 32
MAX_BLOCK_ELEMENTS = 256


def block_elements(n: int) -> int:
    """The largest power of two not above `n`, capped at MAX_BLOCK_ELEMENTS."""
    return min(MAX_BLOCK_ELEMENTS, 1 << (n.bit_length() - 1))


def row_segment_tile(tilelang: ModuleType, elements: int) -> Any:
    """The TileLang program of a warp's dot product over `elements` weights (a PrimFunc)."""
    T = tilelang.language
    block = block_elements(elements)
    blocks = -(-elements // block)

    @T.prim_func
    def row_segment(w: T.Tensor((elements,), "bfloat16"), x: T.Tensor((elements,), "float32"),
                    y: T.Tensor((1,), "float32")):
        with T.Kernel(1, threads=WARP_THREADS):
            acc = T.alloc_fragment((block,), "float32")
            total = T.alloc_fragment((1,), "float32")
            T.clear(acc)
            for kb in T.serial(blocks):
                for e in T.Parallel(block):
                    if kb * block + e < elements:
                        acc[e] += T.cast(w[kb * block + e], "float32") * x[kb * block + e]
            T.reduce_sum(acc, total, dim=0)
            y[0] = total[0]

    return row_segment


def lower_to_cuda(tilelang: ModuleType, func: Any, arch: str) -> str:
    """TileLang's CUDA source for `func`, lowered for `arch` (e.g. sm_90a) without a GPU: the
    target is named, never detected, and no device code is compiled here (nvcc does that for
    the whole kernel)."""
    target = tilelang.tvm.target.Target({"kind": "cuda", "arch": arch})
    with target, tilelang.transform.PassContext(opt_level=3):
        return tilelang.lower(func, target=target).kernel_source
