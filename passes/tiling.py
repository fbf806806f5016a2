"""Tiling: split every fused op into tasks so that each SM streams the same bytes.

Decides the tile of each task. A matrix-vector op of R output rows is cut into
min(R, #SMs) tasks of consecutive rows whose counts differ by at most one: one task per SM
per op is the finest split that keeps every SM's weight stream equal, and tasks larger than a
ring page are streamed page by page anyway, so smaller tiles would only add task overhead.
Attention is tiled by KV head group (a task owns the query heads that share one KV head, so
each key is read once for all of them) and, within a group, by context chunk, so that the KV
cache of a layer is read by many SMs at once instead of a few: the chunk count is the SM count
over the group count (capped). The chunks' partial softmax results are merged by the last
chunk task of the group to finish, which alone signals the op. `embed` and
`argmax` are one task each: they move a few kilobytes.
"""

from __future__ import annotations

from tilertc.ir.graph import DTYPE_BYTES
from tilertc.passes.program import Program, Task, WeightSegment

MAX_ATTENTION_CHUNKS = 32


def row_bytes(program: Program, op) -> int:
    """Bytes of weights behind one output row of a matrix-vector op."""
    g = program.graph
    ws = op.inputs[2:] if op.opcode == "norm_matvec" else [op.inputs[1]]
    per = [g.tensors[w].shape[1] * DTYPE_BYTES[g.tensors[w].dtype] for w in ws]
    return sum(per) if op.attrs.get("interleave") else per[0]


def _segments(program: Program, op, r0: int, r1: int) -> list[WeightSegment]:
    g = program.graph
    if op.opcode == "matvec_add":
        return [WeightSegment(op.inputs[1], r0, r1)]
    ws = list(op.inputs[2:])
    if op.attrs.get("interleave"):
        return [WeightSegment(w, r0, r1) for w in ws]
    segs, base = [], 0
    for w in ws:  # rows of the concatenation [W0; W1; ...]
        n = g.tensors[w].shape[0]
        lo, hi = max(r0, base), min(r1, base + n)
        if lo < hi:
            segs.append(WeightSegment(w, lo - base, hi - base))
        base += n
    return segs


def tile(program: Program) -> Program:
    sms = program.target.num_sms
    g = program.graph
    for op in g.ops():
        if op.opcode in ("norm_matvec", "matvec_add"):
            rows, rb = op.attrs["rows"], row_bytes(program, op)
            n = min(rows, sms)
            bounds = [rows * i // n for i in range(n + 1)]
            for i in range(n):
                r0, r1 = bounds[i], bounds[i + 1]
                program.tasks.append(Task(op.name, op.opcode, i, (r0, r1),
                                          _segments(program, op, r0, r1), (r1 - r0) * rb))
            op.attrs["tile"] = {"tasks": n, "rows_per_task": (rows // n, -(-rows // n)),
                                "bytes_per_task": -(-rows // n) * rb}
            program.decide("tiling", f"{op.name}: {rows} rows x {rb} B -> {n} tasks of "
                           f"{rows // n}-{-(-rows // n)} rows")
        elif op.opcode == "attention":
            a = op.attrs
            groups, heads = a["n_kv_heads"], a["n_heads"] // a["n_kv_heads"]
            chunks = max(1, min(MAX_ATTENTION_CHUNKS, sms // groups))
            seq = g.attrs["max_seq_len"]
            kv_bytes = 2 * -(-seq // chunks) * a["head_dim"] * 2  # K and V of a chunk at full context
            for gi in range(groups):
                for c in range(chunks):
                    program.tasks.append(Task(op.name, op.opcode, gi * chunks + c, (gi, gi + 1),
                                              other_bytes=kv_bytes))
            op.attrs["tile"] = {"tasks": groups * chunks, "chunks": chunks, "signals": groups,
                                "heads_per_task": heads}
            program.decide("tiling", f"{op.name}: {groups} KV groups ({heads} query heads each) x "
                           f"{chunks} context chunks = {groups * chunks} tasks; the last chunk of a "
                           "group to finish merges it")
        else:
            program.tasks.append(Task(op.name, op.opcode, 0, (0, 1)))
            op.attrs["tile"] = {"tasks": 1}
    return program
