"""The pass pipeline: the order in which decisions are made, as one list."""

from __future__ import annotations

from tilertc.ir.build import build_graph
from tilertc.ir.target import Target, get_target
from tilertc.model_specs.spec import ModelSpec
from tilertc.passes.fusion import fuse
from tilertc.passes.packing import pack
from tilertc.passes.program import Program, ScheduleError
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
    place,  # buffers, weight ring depth, shared-memory plan
    assign_roles,  # loader / compute warps
    schedule,  # tasks onto SMs, per-SM streams
    pack,  # packed weight layout in stream order
    synchronize,  # counters and waits
]


def check_weight_format(spec: ModelSpec, tp: int) -> None:
    """FP8 weights are scheduled for every family on one GPU: dense, MoE with or without a
    shared expert (each piece of a routed down row an FP8 row with its own scales), MLA (kv_b's
    derived rows stay FP8: W_uk's transposed rows with one scale per
    `ir/mla.py: derived_scale_cols` columns) and the DSA indexer. Under tensor parallelism
    sharding would cut scale blocks: refused."""
    if not spec.weight_format.is_fp8:
        return
    bf16 = ("; for the bf16 variant, override quantization_config with null (CLI: "
            "--set quantization_config=null, or --weight-dtype bf16)")
    if tp != 1:
        raise ScheduleError(f"{spec.name}: FP8 weights are supported at --tp 1 only, not yet "
                            f"with --tp {tp}{bf16}")


def make_program(spec: ModelSpec, target: str | Target = "h200", tp: int = 1,
                 max_seq_len: int | None = None, tuning: dict | None = None) -> Program:
    """Run every pass over the decode-step graph of `spec` and return the scheduled program.

    `tuning` overrides a pass's default choice (`compute_warps`, `page_kb`), for experiments."""
    check_weight_format(spec, tp)
    program = Program(spec, build_graph(spec, max_seq_len), get_target(target), tp)
    program.config["tuning"] = dict(tuning or {})
    for run in PASSES:
        program = run(program)
    return program
