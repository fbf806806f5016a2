"""The task table: every task of a scheduled program as one row of int32 fields.

The field order is the `Field` enum of decode.cuh; this module and that enum change together.
"""

from __future__ import annotations

import struct

import numpy as np

from tilertc.passes.program import Program, ScheduleError, Task

OPCODES = {"embed": 0, "norm_matvec": 1, "matvec_add": 2, "attention": 3, "argmax": 4}
EPILOGUES = {"none": 0, "silu_mul": 1, "argmax": 2}
WEIGHT_FORMATS = {"bf16": 0, "fp8_e4m3": 1}  # decode.cuh: WeightFormat
FIELDS = (
    "opcode",
    "epilogue",
    "row0",
    "row1",
    "k",
    "in",
    "out",
    "aux",
    "aux2",
    "w_lo",
    "w_hi",
    "row_bytes",
    "wait0",
    "wait0_n",
    "wait1",
    "wait1_n",
    "signal",
    "kcache",
    "vcache",
    "eps",
    "scale",
    "count",
    "chunk",
    "arrive",
    "aux3",
    "w_format",
)
LAG_SHIFT = 24
INT32_MAX = 2**31 - 1


def _f32_bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


def _offset(program: Program, tensor: str) -> int:
    off = program.buffers[tensor].offset
    if off > INT32_MAX:
        raise ScheduleError(
            f"buffer {tensor!r} lies beyond the 2^31-element reach of the task table"
        )
    return off


def encode_task(program: Program, t: Task) -> list[int]:
    from tilertc.passes.tiling import row_bytes

    op = program.graph.op(t.op)
    row = dict.fromkeys(FIELDS, 0)
    row.update(
        opcode=OPCODES[t.opcode],
        row0=t.rows[0],
        row1=t.rows[1],
        signal=t.signal,
        wait0=-1,
        wait1=-1,
    )
    for i, (counter, per_step, lag) in enumerate(t.waits):
        row[f"wait{i}"], row[f"wait{i}_n"] = counter, per_step | (lag << LAG_SHIFT)
    a = op.attrs
    if t.opcode in ("norm_matvec", "matvec_add"):
        row.update(
            epilogue=EPILOGUES[a.get("epilogue", "none")],
            k=a["K"],
            row_bytes=row_bytes(program, op),
            w_format=WEIGHT_FORMATS[program.graph.tensors[t.segments[0].tensor].dtype],
            w_lo=(t.weight_offset // 16) & 0xFFFFFFFF,
            w_hi=(t.weight_offset // 16) >> 32,
            **{"in": _offset(program, op.inputs[0])},
            out=_offset(program, op.outputs[0]),
        )
        if t.opcode == "norm_matvec":
            row.update(aux=_offset(program, op.inputs[1]), eps=_f32_bits(a["eps"]))
        else:
            row["aux"] = _offset(program, op.inputs[2])
        if a.get("epilogue") == "argmax":
            if t.opcode != "norm_matvec":  # the sampler re-derives logits as row sum x 1/rms
                raise ScheduleError(f"op {t.op!r}: the argmax epilogue needs a norm_matvec")
            row["aux2"] = _offset(program, "argmax_partials") + 2 * t.index
            row.update(aux3=_offset(program, "sample_partials"), chunk=t.index)
    elif t.opcode == "attention":
        norms = op.inputs[1:3] if a["qk_norm"] else ()
        kc, vc = op.inputs[-2:]
        row.update(
            **{"in": _offset(program, op.inputs[0])},
            out=_offset(program, op.outputs[0]),
            kcache=_offset(program, kc),
            vcache=_offset(program, vc),
            scale=_f32_bits(a["scale"]),
            count=a["tile"]["chunks"],
            chunk=t.index % a["tile"]["chunks"],
            arrive=t.arrive - t.rows[0],
            aux3=_offset(program, "attn_partials"),
        )
        if norms:
            row.update(aux=_offset(program, norms[0]), aux2=_offset(program, norms[1]))
    elif t.opcode == "embed":
        row["out"] = _offset(program, op.outputs[0])
    elif t.opcode == "argmax":
        lm = next(o for o in program.graph.ops() if o.attrs.get("epilogue") == "argmax")
        row.update(**{"in": _offset(program, "argmax_partials")}, count=lm.attrs["tile"]["tasks"],
                   aux=_offset(program, "sample_partials"))
    return [row[f] for f in FIELDS]


def encode(program: Program) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tasks [n, fields] int32, stream offsets [ctas + 1] int32, stream task ids int32)."""
    tasks = np.array([encode_task(program, t) for t in program.tasks], dtype=np.int32)
    offsets = np.cumsum([0] + [len(s) for s in program.streams]).astype(np.int32)
    ids = np.array([i for s in program.streams for i in s], dtype=np.int32)
    return tasks, offsets, ids
