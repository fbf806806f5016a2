"""`--backend tilelang` for the driver: the kernel source, the nvcc flags it needs, and what the
manifest records about it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tilertc.backends.cuda import codegen
from tilertc.backends.tilelang.compose import compose, device_function
from tilertc.backends.tilelang.requirement import TILELANG_VERSION, load_tilelang
from tilertc.backends.tilelang.segments import PIECE_ELEMENTS, segment_lengths
from tilertc.backends.tilelang.tiles import WARP_THREADS, lower_to_cuda, row_segment_tile
from tilertc.passes.program import Program, ScheduleError
from tilertc.passes.tiling import ROUTED


@dataclass(frozen=True)
class Emitted:
    """A kernel source and what building and describing it needs beyond the CUDA backend's."""

    source: str
    nvcc_flags: tuple[str, ...]
    record: dict[str, Any]


def emit(program: Program) -> Emitted:
    """The CUDA backend's kernel with TileLang tiles for every row-segment length the schedule
    gives a warp (segments.py). TileLang's headers come from its install, hence the flags."""
    if program.tp != 1:  # its tiles were composed with, and checked on, the one-GPU skeleton
        raise ScheduleError(f"--tp {program.tp}: tensor parallelism is not yet in the TileLang "
                            "backend; use --backend cuda")
    if program.spec.weight_format.is_fp8:  # its tiles read bf16 rows only
        raise ScheduleError(f"{program.spec.name}: FP8 weights are not yet in the TileLang "
                            "backend (its row-segment tiles are bf16); use --backend cuda")
    # its tiles cover the row-segment lengths of norm_matvec and matvec_add only
    lacks = {**dict.fromkeys(ROUTED, "MoE experts are"), "head_matvec": "MLA is",
             "ffn_split_k": "the split-K FFN (ffn_split_k) is"}
    op = next((op for op in program.graph.ops() if op.opcode in lacks), None)
    if op is not None:
        raise ScheduleError(f"op {op.name!r}: {lacks[op.opcode]} not yet in the TileLang "
                            "backend; use --backend cuda")
    tilelang = load_tilelang()
    cuda_source = codegen.emit_source(program)  # also refuses what the skeleton cannot run
    lengths = segment_lengths(program)
    functions, tiles = [], {}
    for pieces in lengths:
        name = f"row_segment_{pieces}"
        func = row_segment_tile(tilelang, pieces * PIECE_ELEMENTS)
        source = lower_to_cuda(tilelang, func, program.target.arch)
        functions.append(device_function(source, name, WARP_THREADS))
        tiles[pieces] = name
    record = {
        "tilelang_version": TILELANG_VERSION,
        "seam": "dot_segment",
        "tiles": [{"name": tiles[p], "pieces": p, "threads": WARP_THREADS, "ops": ops}
                  for p, ops in lengths.items()],
    }
    env = tilelang.env
    flags = (f"-I{env.TILELANG_TEMPLATE_PATH}", f"-I{env.CUTLASS_INCLUDE_DIR}")
    return Emitted(compose(cuda_source, functions, tiles), flags, record)
