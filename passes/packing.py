"""Weight packing layout: where each task's weights sit in the packed weight buffer.

Decides the byte offset of every task's weights. Each SM's tasks are laid out back to back in
the order the SM's stream reads them, so that each SM streams one contiguous region and each
task's weights are one contiguous run of whole rows (one bulk copy per ring page). The runtime
packs checkpoint weights into this order once, at load time.
"""

from __future__ import annotations

from tilertc.passes.program import Program

PACK_ALIGN = 128  # bytes; bulk copies need 16, 128 keeps every task on its own cache lines


def pack(program: Program) -> Program:
    offset = 0
    for stream in program.streams:
        for i in stream:
            t = program.tasks[i]
            if t.weight_bytes:
                t.weight_offset = offset
                offset += -(-t.weight_bytes // PACK_ALIGN) * PACK_ALIGN
    program.config["packed_weight_bytes"] = offset
    program.decide("packing", f"packed weights: {offset / 2**20:.1f} MB, one contiguous region "
                   "per SM in stream order")
    return program
