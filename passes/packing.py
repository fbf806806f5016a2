"""Weight packing layout: where each task's weights sit in the packed weight buffer.

Decides the byte offset of every task's weights. Each SM's tasks are laid out back to back in
the order the SM's stream reads them, so that each SM streams one contiguous region and each
task's weights are one contiguous run of whole rows (one bulk copy per ring page). The runtime
packs checkpoint weights into this order once, at load time.

Routed experts cannot be laid out in stream order: which expert a task reads is known only
when the router has run. They are packed after the static region, expert-major (each expert's
gate and up rows interleaved, then its down rows), so that a routed task reads the rows of
its slot's expert at a computed offset; a task's static part (the shared expert's rows of a
`moe_down_add`) stays in stream order.
"""

from __future__ import annotations

from tilertc.passes.program import Program, Task
from tilertc.passes.tiling import ROUTED, weight_row_bytes

PACK_ALIGN = 128  # bytes; bulk copies need 16, 128 keeps every task on its own cache lines


def static_bytes(program: Program, t: Task) -> int:
    """Bytes of the weight rows a task reads that are known before the run (its segments)."""
    tensors = program.graph.tensors
    return sum((s.row1 - s.row0) * weight_row_bytes(tensors[s.tensor]) for s in t.segments)


def pack(program: Program) -> Program:
    offset = 0
    for stream in program.streams:
        for i in stream:
            t = program.tasks[i]
            n = static_bytes(program, t)
            if n:
                t.weight_offset = offset
                offset += -(-n // PACK_ALIGN) * PACK_ALIGN
    g = program.graph
    experts = {w for op in g.ops() if op.opcode in ROUTED for w in op.inputs
               if ".mlp.experts." in (g.tensors[w].hf_name or "")}
    expert_bytes = sum(g.tensors[w].nbytes for w in experts)
    program.config.update(packed_weight_bytes=offset, expert_weight_bytes=expert_bytes)
    program.decide("packing", f"packed weights: {offset / 2**20:.1f} MB, one contiguous region "
                   "per SM in stream order" + (
                       f"; routed experts: {expert_bytes / 2**20:.1f} MB after it, expert-major, "
                       "read at the offset of the expert a slot is routed to"
                       if expert_bytes else ""))
    fmt = program.spec.weight_format
    if fmt.is_fp8:
        program.decide("packing", f"FP8 rows: a row's K e4m3 bytes, then the fp32 scales of "
                       f"its {fmt.block[1]}-column blocks (of its {fmt.block[0]}-row block row), "
                       "padded to 16 B, so that one bulk copy brings a page's values and scales "
                       "together; lm_head stays bf16")
    return program
