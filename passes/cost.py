"""The cost model: predicted time of a task, an op and a decode step.

A task streams its weights at the SM's share of HBM bandwidth and reads its other global data
(KV cache) at the same rate; every op boundary costs a dependency wait plus the activation
hand-off (`BOUNDARY_NS`, measured ~3 us per all-to-all boundary in the feasibility prototype of
DESIGN.md). The boundary covers an SM's first task of an op; each further task of the op on
that SM adds its own fixed cost (`TASK_NS`: staging its input, its epilogue and signal), so an
op cut into more tasks than SMs costs more than its bytes say. An FP8 tile op's boundary is
longer by its input's staging as digits (`DIGIT_ROUND_NS` per round of 128-column blocks its
compute warps take, each warp `STAGE_BLOCKS` at a time), or, with ready digits, its
producer's by writing them (`READY_PRODUCER_NS`). FP8 rows on the CUDA cores stream
slower than their bytes where their measured page compute is slower than a page's arrival
(dense rows; routed down rows, whose pieces cost the most). An op takes as long as its
slowest SM; a step is the sum of its ops, because each op waits for all tasks of the op before
it. Chunked attention is charged what the H200
measured rather than its bytes (docs/performance.md): a chain of dependent global round trips
per layer (MLA's: its q absorption, attention and value expansion together), and keys and
values read at the rate its loads in flight allow. That part is for the
prediction only: the scheduler balances SMs by `task_ns`, where every attention task of an op
costs the same anyway. Under tensor parallelism an op whose output is a
partial sum adds one all-reduce: the link's fixed latency plus a ring's 2(tp - 1)/tp of the
fp32 vector over NVLink (`Target.link_*`). The model is calibrated against `tilertc bench`.
"""

from __future__ import annotations

from tilertc.ir.fp8 import TILE_BLOCK_COLS
from tilertc.ir.graph import Op
from tilertc.passes.fusion_moe import down_inputs
from tilertc.passes.program import Program, Task
from tilertc.passes.sharding import ends_in_allreduce
from tilertc.passes.tiling import DENSE_PROJECTIONS, is_fp8_rows, is_tiled

BOUNDARY_NS = 3000.0
# llama-3.2-1b on the H200, 2026-11-30: attention spans 11.7 us per layer at 1k context, of
# which ~0.5 us is bytes and 3 us the boundary. Keys and values stream through the weight ring
# (bulk copies, prefetched by the loader): at 8k context a task's extra 112 KB cost 6.9 us per
# layer, 16 KB/us per SM (with plain loads it had cost 15.3 us).
ATTENTION_CHAIN_NS = 8000.0
ATTENTION_KV_BYTES_PER_S_PER_SM = 16e9
# MLA's chain (q absorption, attention, value expansion; each a latency chain of small tasks):
# DeepSeek-V3.2's dense layer on the H200, 2026-12-01 (docs/performance.md, session 22,
# profile): those ops spanned 13.1 + 16.4 + 12.6 us where their bytes and boundaries are
# charged 5.9 + 7.4 + 5.0. Charged once per layer, on the attention op.
MLA_CHAIN_NS = 24000.0
# Qwen3-30B-A3B on the H200, 2026-11-30 (docs/performance.md, "Issue 6"): the routed gate/up,
# 8 tasks of ~47 KB per SM per layer, took 3.78 us per task (dependencies met to done) where
# its bytes at the SM's share of 4.4 TB/s take 1.43 us: ~2.4 us of fixed cost per task.
TASK_NS = 2400.0
# Staging an FP8 tile task's input as digits (decode/tile_digits.cuh: stage_digits, a warp
# STAGE_BLOCKS blocks at a time), on the H200 (docs/performance.md): 0.8-1.0 us longer than a bf16
# task's copy at llama-3.1-8b's K = 4096 (session 18, then 2 rounds of a block a warp; one round of
# 4 since session 22, which left that model's step time as it was), and 1.0-1.8 us for each
# further round (session 22 stream probes: llama-3.1-8b's down, K = 14336, against its o_proj;
# DeepSeek-V3.2's o_proj and dense down, 1.2-1.5 us faster at 2 and 3 rounds than at 8 and 9).
# Since session 25 the input comes in one round trip (cp.async) and a round is the conversion
# alone, instruction-bound: qwen3-32b's staging over bf16's copy, 1 round (qkv) +1.0 us, 4
# (down, K = 25600) +4.0 us (tools/stream_probe.py, docs/performance.md): still ~1 us a round.
STAGE_BLOCKS = 4
DIGIT_ROUND_NS = 1000.0
# With ready digits (passes/digits.py) a consumer copies its input's digits in, no slower than
# a bf16 task's copy, and a producer's task takes longer by writing them: llama-3.1-8b FP8 on
# the H200, 2026-12-02 (docs/performance.md, session 26, profile): o_proj, a producer that
# reads no ready digits, 6.60 -> 7.45 us a task; the step 3.101 -> 3.060 ms, as these charges
# predict (-1.45 us a layer).
READY_PRODUCER_NS = 850.0
# The same model's dense FP8 projections as rows on the CUDA cores (`--tune fp8_mma=0`): a
# gate/up task streamed 27 KB/us where a bf16 one streams 33, the SM's share (session 17),
# its pages' dot product (~2 us a page) slower than they arrive.
FP8_ROW_STREAM_SHARE = 0.87
# DeepSeek-V3.2's routed down projection (FP8 rows of 9 pieces, one per slot and the shared
# expert's) on the H200, 2026-12-01 (docs/performance.md, sessions 19 and 20, stream probe):
# 3.1 us of compute per 57 KB page, 18 KB/us against a bf16 page's 33.
ROUTED_DOWN_FP8_STREAM_SHARE = 0.55
# DeepSeek-V3.2's MoE top-k (256 experts in 8 groups, one SM) on the H200, 2026-12-01: 7.1 us
# (profile) for bytes that take none. Charged so that the scheduler sees its SM busy and gives
# the routed experts, which wait for it, the other SMs.
MOE_TOPK_NS = 7000.0


def chain_ns(op: Op) -> float:
    """What an attention op costs beyond its bytes and boundary (the chain of dependent round
    trips that does not shrink with the bytes, under tensor parallelism either); 0 for others."""
    return {"attention": ATTENTION_CHAIN_NS, "mla_attention": MLA_CHAIN_NS}.get(op.opcode, 0.0)


def task_ns(program: Program, task: Task) -> float:
    per_sm = program.target.hbm_bandwidth / program.target.num_sms
    fixed = MOE_TOPK_NS if task.opcode == "moe_topk" else 0.0
    return (task.weight_bytes + task.other_bytes) / per_sm * 1e9 + fixed


def allreduce_ns(program: Program, op: Op) -> float:
    """The all-reduce after `op` across the tp ranks, if it ends in one."""
    tp, tgt = program.tp, program.target
    if not ends_in_allreduce(program, op):
        return 0.0
    nbytes = program.graph.tensors[op.outputs[0]].numel * 4
    return tgt.link_latency_ns + 2 * (tp - 1) / tp * nbytes / tgt.link_bandwidth * 1e9


def predicted_task_ns(program: Program, task: Task) -> float:
    """`task_ns`, except for chunked attention (keys and values at their measured read rate),
    dense FP8 rows and routed FP8 down rows (their pages at the rate the CUDA cores' dot
    product keeps up with)."""
    if task.opcode == "attention":
        return task.other_bytes / ATTENTION_KV_BYTES_PER_S_PER_SM * 1e9
    op = program.graph.op(task.op)
    if op.opcode in DENSE_PROJECTIONS and is_fp8_rows(program, op):
        return task.est_ns / FP8_ROW_STREAM_SHARE
    if op.opcode == "moe_down_add" and not is_tiled(program, op):
        _, _, _, _, _, experts, _ = down_inputs(op)
        if program.graph.tensors[experts[0]].dtype == "fp8_e4m3":
            return task.est_ns / ROUTED_DOWN_FP8_STREAM_SHARE
    return task.est_ns


def task_fixed_ns(program: Program, task: Task) -> float:
    """A task's fixed cost when it is not its SM's first of its op. A routed gate/up task's
    slot is busy with probability `busy` (tiling): an empty slot's task only waits and
    signals, so the expected cost is that fraction of `TASK_NS`."""
    return TASK_NS * program.graph.op(task.op).attrs["tile"].get("busy", 1.0)


def digit_staging_ns(program: Program, op: Op) -> float:
    """What staging an FP8 tile op's input as digits (decode/tile_digits.cuh: stage_digits) adds to
    its boundary, none where its producer made them (ready digits), and what writing its
    consumer's digits adds to a producer's: 0 for any other op."""
    if not is_tiled(program, op):
        return 0.0
    writes = READY_PRODUCER_NS if "digits_for" in op.attrs else 0.0
    if op.attrs.get("ready_digits"):
        return writes
    blocks = op.attrs["K"] // TILE_BLOCK_COLS
    return writes + DIGIT_ROUND_NS * -(-blocks // (STAGE_BLOCKS * program.config["compute_warps"]))


def op_times_ns(program: Program) -> dict[str, float]:
    """Per fused op: the busiest SM's time on it (its tasks' bytes, and the fixed cost of each
    task after the SM's first of the op), plus one boundary (and an all-reduce, or an FP8 tile
    op's digit staging). An op that runs beside a partner on SMs of its own (tiling:
    `beside_partner`) adds only what it takes beyond the partner."""
    per: dict[str, dict[int, float]] = {}
    for t in program.tasks:
        sms = per.setdefault(t.op, {})
        # the SM's first task of the op: its fixed cost is part of the boundary
        sms[t.sm] = sms[t.sm] + task_fixed_ns(program, t) if t.sm in sms else 0.0
        sms[t.sm] += predicted_task_ns(program, t)
    times = {op.name: max(per[op.name].values()) + BOUNDARY_NS + allreduce_ns(program, op)
             + chain_ns(op)
             + digit_staging_ns(program, op)
             for op in program.graph.ops()}
    for op in program.graph.ops():
        partner = op.attrs["tile"].get("beside")
        if partner is not None:
            times[op.name] = max(0.0, times[op.name] - times[partner])
    return times


def step_ns(program: Program) -> float:
    return sum(op_times_ns(program).values())


def roofline_ns(program: Program) -> float:
    """Time to read the step's bytes once at the target's bandwidth."""
    nbytes = sum(t.weight_bytes + t.other_bytes for t in program.tasks)
    return nbytes / program.target.hbm_bandwidth * 1e9
