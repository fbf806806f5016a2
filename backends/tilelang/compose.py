"""Compose TileLang's tiles with the CUDA backend's persistent skeleton into one kernel source.

TileLang lowers each tile to a CUDA source holding one `extern "C" __global__` function. Here
that function becomes a `__device__` function (its thread index a parameter: the warp's lane)
in namespace `tilertc_tl`, after TileLang's `#include`s, ahead of the CUDA backend's source.
The skeleton's one seam for matrix-vector math, `dot_segment` in decode/dot.cuh (one warp, a
segment of a weight row in a ring page times the staged vector), is renamed
`dot_segment_simt` and a dispatcher of the same signature takes its place: a segment length
with a TileLang tile runs the tile, any other runs the CUDA loop. The kernel keeps exactly one
`__global__`, the skeleton's.

A tile that needs more than one warp's own resources cannot be composed this way (the loader
warp never joins a block barrier, and page groups run tiles concurrently), so tiles using block
barriers, shared memory, block indices or TMA descriptors are refused by name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SEAM = ("__device__ __forceinline__ float dot_segment(const uint4* w, const float* x, "
        "int begin, int end, int lane) {")
KERNEL = re.compile(
    r'extern "C" __global__ void (?:__launch_bounds__\((\d+)(?:, *\d+)?\) )?(\w+)\(([^)]*)\) \{')
NEEDS_MORE_THAN_A_WARP = ("__syncthreads", "__sync_thread_partial", "bar.sync", "barrier.sync",
                          "blockIdx", "__shared__", "buf_dyn_shmem", "CUtensorMap")
LANE = "tl_lane"


class CompositionError(RuntimeError):
    """TileLang's output or the CUDA skeleton is not in the shape the composition relies on."""


@dataclass(frozen=True)
class DeviceFunction:
    """A tile as a `__device__` function: its name, TileLang's includes, its definition."""

    name: str
    prelude: str
    text: str


def device_function(source: str, name: str, threads: int) -> DeviceFunction:
    """TileLang's single-kernel CUDA `source` as `__device__ void name(<params>, int tl_lane)`,
    checked to run on `threads` threads (one warp) without block-wide resources."""
    kernels = list(KERNEL.finditer(source))
    if len(kernels) != 1:
        raise CompositionError(f"tile {name}: TileLang emitted {len(kernels)} kernel definitions, "
                               "expected 1")
    m = kernels[0]
    if m.group(1) is None or int(m.group(1)) != threads:
        raise CompositionError(f"tile {name}: TileLang launches it with {m.group(1)} threads, the "
                               f"seam runs it on {threads} (did it add warp specialization?)")
    body = source[m.end():].replace("threadIdx.x", LANE)
    used = [token for token in NEEDS_MORE_THAN_A_WARP if token in body]
    if used:
        raise CompositionError(f"tile {name} uses {', '.join(used)}: it needs more than its own "
                               "warp and cannot run inside the skeleton's compute warps")
    prelude = source[:source.index('extern "C"')]  # the includes, before the declaration
    head = f"__device__ __forceinline__ void {name}({m.group(3)}, int {LANE}) {{"
    return DeviceFunction(name, prelude.strip() + "\n", head + body.rstrip() + "\n")


def dispatcher(tiles: dict[int, str]) -> str:
    """The seam: `dot_segment` running the tile of its segment length (pieces), else the CUDA
    loop. TileLang's reduction leaves the sum in lane 0; the shuffle gives it to every lane, as
    the CUDA loop does."""
    cases = "".join(
        f"    case {pieces}: tilertc_tl::{name}(reinterpret_cast<const bfloat16_t*>(w + begin), "
        "x + 8 * begin, &y, lane); break;\n" for pieces, name in sorted(tiles.items()))
    signature = "(const uint4* w, const float* x, int begin, int end, int lane)"
    return (
        f"__device__ __forceinline__ float dot_segment_simt{signature};\n"
        "// tilertc --backend tilelang: a segment with a TileLang tile runs it (tilertc_tl)\n"
        f"__device__ __forceinline__ float dot_segment{signature} {{\n"
        "  float y = 0.f;\n"
        "  switch (end - begin) {\n"
        f"{cases}"
        "    default: return dot_segment_simt(w, x, begin, end, lane);\n"
        "  }\n"
        "  return __shfl_sync(0xffffffffu, y, 0);\n"
        "}\n"
        f"__device__ __forceinline__ float dot_segment_simt{signature} {{"
    )


def compose(cuda_source: str, functions: list[DeviceFunction], tiles: dict[int, str]) -> str:
    """One kernel source: TileLang's includes and tiles, then `cuda_source` (the CUDA backend's
    prelude and skeleton) with its `dot_segment` seam dispatching by segment length to `tiles`
    ({pieces: function name})."""
    if cuda_source.count(SEAM) != 1:
        raise CompositionError(
            "the CUDA skeleton no longer has the dot_segment seam this backend composes at "
            f"({SEAM!r}); backends/tilelang/compose.py and backends/cuda/decode/dot.cuh change "
            "together")
    preludes = list(dict.fromkeys(f.prelude for f in functions))
    header = ("// Generated by tilertc --backend tilelang: TileLang's includes and tiles, then the "
              "CUDA backend's source,\n// whose dot_segment seam runs the tiles.\n")
    tl_block = "namespace tilertc_tl {\n" + "\n".join(f.text for f in functions) + \
        "}  // namespace tilertc_tl\n"
    return header + "\n".join(preludes) + "\n" + tl_block + "\n" + \
        cuda_source.replace(SEAM, dispatcher(tiles))
