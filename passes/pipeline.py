"""The pass pipeline: the order in which decisions are made, as one list."""

from __future__ import annotations

from tilertc.ir.build import build_graph
from tilertc.ir.target import Target, get_target
from tilertc.model_specs.spec import ModelSpec
from tilertc.passes.digits import ready_digits
from tilertc.passes.fusion import fuse
from tilertc.passes.packing import pack
from tilertc.passes.program import Program
from tilertc.passes.residency import place
from tilertc.passes.roles import assign_roles
from tilertc.passes.scheduling import schedule
from tilertc.passes.sharding import shard
from tilertc.passes.synchronization import synchronize
from tilertc.passes.tiling import tile

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


def make_program(spec: ModelSpec, target: str | Target = "h200", tp: int = 1,
                 max_seq_len: int | None = None, tuning: dict | None = None) -> Program:
    """Run every pass over the decode-step graph of `spec` and return the scheduled program.

    `tuning` overrides a pass's default choice (`compute_warps`, `page_kb`, `page_groups`,
    `attn_chunks`, `ffn_split_k`, `fp8_mma`, `ready_digits`), for experiments."""
    program = Program(spec, build_graph(spec, max_seq_len), get_target(target), tp)
    program.config["tuning"] = dict(tuning or {})
    for run in PASSES:
        program = run(program)
    return program
