"""Weight packing layout: where each task's weights sit in the packed weight buffer.

Decides the byte offset of every task's weights. Each SM's tasks are laid out back to back in
the order the SM's stream reads them, so that each SM streams one contiguous region and each
task's weights are one contiguous run of whole rows (one bulk copy per ring page). The runtime
packs checkpoint weights into this order once, at load time.

A split-K FFN task's region is its slice's gate/up rows (interleaved pairs), then its slice of
W_down's columns as `hidden` rows of the slice's width: one region, two row sizes.

Routed experts cannot be laid out in stream order: which expert a task reads is known only
when the router has run. They are packed after the static region, one region per routed op,
expert-major with a fixed stride: a `moe_gate_up` region holds each expert's gate and up rows
interleaved (as a dense gate/up task packs them), a `moe_down_add` region each expert's down
rows. A routed task's `weight_offset` is where its rows lie in expert 0's part of the region,
and the kernel adds `expert × stride` for the expert its slot is routed to, so the address
comes from the expert id alone (`op.attrs["experts_packed"]`). A task's static part (the
shared expert's rows of a `moe_down_add`) stays in stream order, at its `static_offset`.
"""

from __future__ import annotations

from tilertc.ir.graph import TensorKind
from tilertc.passes.fusion_moe import down_inputs
from tilertc.passes.program import Program, Task
from tilertc.passes.tiling import ROUTED, is_tiled, scale_cols, segment_bytes, weight_row_bytes

PACK_ALIGN = 128  # bytes; bulk copies need 16, 128 keeps every task on its own cache lines


def static_bytes(program: Program, t: Task) -> int:
    """Bytes of the weight rows a task reads that are known before the run (its segments)."""
    return sum(segment_bytes(program, s) for s in t.segments)


def expert_weights(op) -> list[list[str]]:
    """Per expert of a routed op, the weight tensors one of its packed rows is made of: gate
    and up (interleaved) of a `moe_gate_up`, down of a `moe_down_add`."""
    if op.opcode == "moe_gate_up":
        ws = op.inputs[3:]
        return [list(ws[i:i + 2]) for i in range(0, len(ws), 2)]
    return [[w] for w in down_inputs(op)[5]]


def _align(n: int) -> int:
    return -(-n // PACK_ALIGN) * PACK_ALIGN


def _pack_experts(program: Program, offset: int) -> int:
    """Each routed op's region from `offset`, expert-major; sets the routed tasks' offsets."""
    g = program.graph
    tasks: dict[str, list[Task]] = {}
    for t in program.tasks:
        if t.opcode in ROUTED:
            tasks.setdefault(t.op, []).append(t)
    for op in g.ops():
        if op.opcode not in ROUTED:
            continue
        experts = expert_weights(op)
        first = [g.tensors[w] for w in experts[0]]
        rows = first[0].shape[0]
        row = sum(weight_row_bytes(w) for w in first)
        stride = _align(rows * row)
        op.attrs["experts_packed"] = {"offset": offset, "stride": stride, "row_bytes": row,
                                      "experts": len(experts)}
        inter = op.attrs["intermediate_size"]
        for t in tasks[op.name]:  # a gate/up task's rows are those of its slot's expert
            r0 = t.rows[0] % inter if op.opcode == "moe_gate_up" else t.rows[0]
            t.weight_offset = offset + r0 * row
        offset += stride * len(experts)
    return offset


def pack(program: Program) -> Program:
    offset = 0
    for stream in program.streams:
        for i in stream:
            t = program.tasks[i]
            n = static_bytes(program, t)
            if n:
                if t.opcode in ROUTED:
                    t.static_offset = offset
                else:
                    t.weight_offset = offset
                offset += _align(n)
    static = offset
    offset = _pack_experts(program, offset)
    program.config.update(packed_weight_bytes=offset, expert_weight_bytes=offset - static)
    program.decide("packing", f"packed weights: {static / 2**20:.1f} MB, one contiguous region "
                   "per SM in stream order" + (
                       f"; routed experts: {(offset - static) / 2**20:.1f} MB after it, one "
                       "region per routed op, expert-major with a fixed stride, read at the "
                       "offset of the expert a slot is routed to" if offset > static else ""))
    fmt = program.spec.weight_format
    if fmt.is_fp8:
        program.decide("packing", f"FP8 rows: a row's K e4m3 bytes, then the fp32 scales of "
                       f"its {fmt.block[1]}-column blocks (of its {fmt.block[0]}-row block row), "
                       "padded to 16 B, so that one bulk copy brings a page's values and scales "
                       "together; lm_head stays bf16" + _fp8_pieces(program))
    return program


def _fp8_pieces(program: Program) -> str:
    """What the FP8 decision adds for MLA's derived kv_b rows and a shared expert's pieces."""
    g, out = program.graph, ""
    w_uk = next((w for w in g.tensors.values() if w.kind is TensorKind.WEIGHT
                 and w.attrs.get("derived") == "w_uk_t" and "scale_inv" in w.attrs), None)
    if w_uk is not None:
        out += ("; MLA's kv_b rows stay e4m3: W_uv's rows are kv_b's, W_uk's transposed rows "
                f"(q absorption) run down kv_b's block rows and carry one scale per "
                f"{scale_cols(w_uk)} columns (the heads' row offsets in kv_b are multiples of "
                f"it): {weight_row_bytes(w_uk)} B per row of {w_uk.shape[1]} values, scales "
                "derived from kv_b's at load")
    downs = [op for op in g.ops() if op.opcode == "moe_down_add"]
    if any(is_tiled(program, op) for op in downs):
        out += ("; the routed down projection's experts (and the shared expert) are packed as "
                "FP8 tiles, a tile's units gathered per slot at run time")
    elif any(op.attrs.get("shared_intermediate") for op in downs):
        out += ("; a routed down row's shared-expert piece is an FP8 row with its own scales, "
                "like each slot's")
    return out
