"""The pass pipeline: the order in which decisions are made, as one list; and the one decision
that takes the whole list twice, FP8 projections as tiles or as rows (`make_program`)."""

from __future__ import annotations

from tilertc.ir.build import build_graph
from tilertc.ir.target import Target, get_target
from tilertc.model_specs.spec import ModelSpec
from tilertc.passes.cost import step_ns
from tilertc.passes.digits import ready_digits
from tilertc.passes.fusion import fuse
from tilertc.passes.packing import pack
from tilertc.passes.program import Program
from tilertc.passes.residency import place
from tilertc.passes.roles import assign_roles
from tilertc.passes.scheduling import schedule
from tilertc.passes.sharding import shard
from tilertc.passes.synchronization import synchronize
from tilertc.passes.tiling import has_tiles, tile

# how make_program's decision between FP8 tiles and rows begins (the compile summary shows it)
FP8_PATH = "FP8 projections as "
# the knobs that, asked for, need FP8 tiles (and so skip make_program's choice of rows)
NEEDS_TILES = ("ready_digits", "vexp_digits")

PASSES = [
    shard,  # per-rank shard of every op under tensor parallelism
    fuse,  # elementwise work into matrix-vector ops and attention
    tile,  # tasks per fused op, balanced bytes per SM
    ready_digits,  # FP8 tile inputs written as digits by their producers
    place,  # buffers, weight ring depth, shared-memory plan
    assign_roles,  # loader / compute warps
    schedule,  # tasks onto SMs, per-SM streams
    pack,  # packed weight layout in stream order
    synchronize,  # counters and waits
]


def run_passes(spec: ModelSpec, target: str | Target, tp: int, max_seq_len: int | None,
               tuning: dict) -> Program:
    """Every pass of PASSES over the decode-step graph of `spec`, in order."""
    program = Program(spec, build_graph(spec, max_seq_len), get_target(target), tp)
    program.config["tuning"] = dict(tuning)
    for run in PASSES:
        program = run(program)
    return program


def make_program(spec: ModelSpec, target: str | Target = "h200", tp: int = 1,
                 max_seq_len: int | None = None, tuning: dict | None = None) -> Program:
    """Run every pass over the decode-step graph of `spec` and return the scheduled program.

    `tuning` overrides a pass's default choice (`compute_warps`, `page_kb`, `page_groups`,
    `attn_chunks`, `router_tasks`, `ffn_split_k`, `fp8_mma`, `ready_digits`,
    `vexp_digits`), for experiments.

    Unless `fp8_mma` or one of `NEEDS_TILES` asks for tiles, a program with FP8 tiles is scheduled a
    second time with FP8 rows on the CUDA cores, and the one the cost model predicts faster is
    kept: tiles stream at the full share of bandwidth but stage their input as digits, which
    a model of many small tasks pays more often than its bytes repay (qwen3-30b-a3b on the H200:
    rows 3.50 ms/token against tiles 3.73; llama-3.1-8b, qwen3-32b, DeepSeek-V3.2 and GLM-5:
    tiles faster; docs/performance.md, session 31, where the model orders all of them so)."""
    tuning = dict(tuning or {})
    program = run_passes(spec, target, tp, max_seq_len, tuning)
    if (tuning.get("fp8_mma") is not None or any(tuning.get(k) for k in NEEDS_TILES)
            or not has_tiles(program)):
        return program
    rows = run_passes(spec, target, tp, max_seq_len, tuning | {"fp8_mma": False})
    tiles_ms, rows_ms = step_ns(program) / 1e6, step_ns(rows) / 1e6
    pick, how = (program, "tiles for the tensor cores") if tiles_ms <= rows_ms else \
        (rows, "rows on the CUDA cores")
    pick.decide("tiling", f"{FP8_PATH}{how}: the cost model predicts {tiles_ms:.3f} ms a step "
                f"with tiles, {rows_ms:.3f} with rows")
    return pick
