"""The task table: every task of a scheduled program as one row of int32 fields.

The field order is the `Field` enum of decode/task_table.cuh; this module and that enum
change together.
A MoE model's table has the `MOE_FIELDS` after the others (and the `SHARED_FIELDS` with a
shared expert), an MLA model's the `MLA_FIELDS` (and with FP8 weights the `MLA_FP8_FIELDS`), a
DSA model's then the `DSA_FIELDS` (decode/task_table.cuh declares them under `#if MOE`, `#if
MOE_SHARED_K`, `#if MLA`, `#if MLA && WEIGHT_FP8` and `#if DSA`), a kernel with a split-K FFN's the
`FFN_FIELDS` (`#if FFN_SPLIT_K`), so that a dense model's table and kernel are what they were
without them. Under tensor parallelism the `TP_FIELDS` come last (`#if TP > 1`).
"""

from __future__ import annotations

import struct

import numpy as np

from tilertc.passes.digits import normalizes
from tilertc.passes.fusion_moe import down_inputs
from tilertc.passes.packing import expert_weights
from tilertc.passes.program import Program, ScheduleError, Task
from tilertc.passes.tiling import scale_cols

OPCODES = {"embed": 0, "norm_matvec": 1, "matvec_add": 2, "attention": 3, "argmax": 4,
           "moe_topk": 5, "moe_gate_up": 6, "moe_down_add": 7, "head_matvec": 8,
           "mla_attention": 9, "dsa_score": 10, "dsa_topk": 11, "ffn_split_k": 12}
# A routed task's rows are `slots` pieces, piece j from the expert the router put in slot
# slot0 + j; the kernel's loader reads that expert's id only after acquiring `route`.
MOE_FIELDS = ("route", "ids", "slot0", "slots", "expert_stride")
# A down task of a model with a shared expert: its rows end with the shared expert's down rows,
# packed in the SM's static region at `shared_lo`/`shared_hi` (bytes / 16), its input with the
# shared expert's activations at act offset `shared_in`.
SHARED_FIELDS = ("shared_in", "shared_lo", "shared_hi")
# A head_matvec's output rows come in heads of `head_rows`, each reading its own `k` inputs,
# `in_stride` apart; the task with `append` set also runs MLA's latent prologue and appends the
# step's row to the latent cache.
MLA_FIELDS = ("in_stride", "head_rows", "append")
# An FP8 head_matvec's rows have one scale per 4 << `scale_shift` columns (q absorption's may
# be fewer than a block's: passes/tiling.py: scale_cols).
MLA_FP8_FIELDS = ("scale_shift",)
# A dsa_score task's key LayerNorm bias (its weight is at `aux3`); an MLA attention task's wait
# (0 or 1) for the indexer's selection, which the kernel skips while the selection is every token
# (passes/synchronization.py: selection_wait; -1: none).
DSA_FIELDS = ("norm_bias", "selection_wait")
# A kernel with a split-K FFN, whose output is a fixed-point buffer (fx64): whether a task's input
# (`fixed_in`) or residual (`fixed_res`) is one, and the act offset of the start value of one a
# matvec_add also writes (`fixed_out`, -1: none).
FFN_FIELDS = ("fixed_in", "fixed_res", "fixed_out")
# Ready digits (passes/digits.py): act offset of the digits a consumer reads in place of its
# input (`digits_in`, -1: none); a producer's: the act offset it writes its consumer's digits
# to (`digits_out`, -1: none), that consumer's input length (`digits_k`) and norm weight
# (`digits_gamma`, -1: none).
DIGIT_FIELDS = ("digits_in", "digits_out", "digits_k", "digits_gamma")
# Tensor parallelism: a task that exchanges with the other ranks (an all-reducing op's, the
# sampler) arrives on exchange counter `xchg` of every rank after writing its part into its
# rank's slot of the receive buffer at act offset `xchg_buf` (slots `xchg_stride` floats
# apart); -1: no exchange (passes/synchronization.py).
TP_FIELDS = ("xchg", "xchg_buf", "xchg_stride")
EPILOGUES = {"none": 0, "silu_mul": 1, "argmax": 2}
# decode/task_table.cuh: WeightFormat
WEIGHT_FORMATS = {"bf16": 0, "fp8_e4m3": 1, "fp8_e4m3_tiles": 2}
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


def _low_bits(x: int) -> int:
    """The low 32 bits of x as an int32 (the kernel reads them back as unsigned)."""
    return ((x & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000


def _offset(program: Program, tensor: str) -> int:
    off = program.buffers[tensor].offset
    if off > INT32_MAX:
        raise ScheduleError(
            f"buffer {tensor!r} lies beyond the 2^31-element reach of the task table"
        )
    return off


def fields(program: Program) -> tuple[str, ...]:
    """The task table's columns for this program (the device library compiles the MoE ones when
    there is a router, codegen's MOE, the shared expert's with one, codegen's MOE_SHARED_K,
    the MLA ones when there is MLA attention (and with FP8 weights the MLA FP8 ones), the DSA
    ones with an indexer, the FFN ones with a split-K FFN, the digit ones with ready digits,
    the TP ones under tp > 1)."""
    ops = program.graph.ops()
    opcodes = {op.opcode for op in ops}
    shared = any(op.attrs["shared_intermediate"] for op in ops if op.opcode == "moe_down_add")
    mla = "mla_attention" in opcodes
    fp8 = program.spec.weight_format.is_fp8
    return (FIELDS + (MOE_FIELDS if "moe_topk" in opcodes else ())
            + (SHARED_FIELDS if shared else ())
            + (MLA_FIELDS if mla else ()) + (MLA_FP8_FIELDS if mla and fp8 else ())
            + (DSA_FIELDS if "dsa_score" in opcodes else ())
            + (FFN_FIELDS if "ffn_split_k" in opcodes else ())
            + (DIGIT_FIELDS if any(op.attrs.get("ready_digits") for op in ops) else ())
            + (TP_FIELDS if program.tp > 1 else ()))


def _routed(program: Program, t: Task, op, counters: dict[str, int]) -> dict[str, int]:
    """The MoE fields of a routed task (see MOE_FIELDS) and its combine weights' offset."""
    a = op.attrs
    ids, weights = (op.inputs[2], None) if t.opcode == "moe_gate_up" else op.inputs[1:3]
    topk = next(o.name for o in program.graph.producers(op.name) if ids in o.outputs)
    route = counters[topk]
    if program.counters[route].per_step != 1:  # the loader waits for step + 1
        raise ScheduleError(f"op {topk!r}: the router must be one task")
    slot, stride = t.rows[0] // a["intermediate_size"], a["experts_packed"]["stride"] // 16
    if stride > INT32_MAX:
        raise ScheduleError(f"op {op.name!r}: one expert's packed weights exceed 32 GiB")
    out = {"route": route, "ids": _offset(program, ids),
           "slot0": slot if t.opcode == "moe_gate_up" else 0,
           "slots": 1 if t.opcode == "moe_gate_up" else a["slots"],
           "expert_stride": stride}
    if weights:
        out["aux2"] = _offset(program, weights)
    shared_act = down_inputs(op)[3] if t.opcode == "moe_down_add" else None
    if shared_act:
        offset = t.static_offset // 16
        out.update(shared_in=_offset(program, shared_act), shared_lo=_low_bits(offset),
                   shared_hi=offset >> 32)
    return out


def _view(program: Program, op, part: str) -> int:
    """Act offset of a fused MLA op's input `part` (`io`: a view into a concatenated output)."""
    base, off = op.attrs["io"][part]
    return _offset(program, base) + off


def _head_matvec(program: Program, t: Task, op) -> dict[str, int]:
    """A head_matvec's MLA fields; the task with `append` also gets what the latent prologue
    reads (the kv_a part of the input projection, kv_a_layernorm) and the cache it appends to;
    v expansion (`merges`) the attention's chunk count and partial results."""
    a = op.attrs
    w = program.graph.tensors[op.inputs[1]]
    if a["rows_per_head"] * w.shape[0] >= 1 << 32:  # decode/shared.cuh: Divisor
        raise ScheduleError(f"op {op.name!r}: {w.shape[0]} rows in heads of "
                            f"{a['rows_per_head']} are past the kernel's 32-bit head division")
    out = {"in": _view(program, op, "x"), "in_stride": a["in_stride"],
           "head_rows": a["rows_per_head"], "append": 0}
    if "merges" in a:
        out.update(count=program.graph.op(a["merges"]).attrs["tile"]["chunks"],
                   aux3=_offset(program, "mla_partials"))
    if "scale_inv" in w.attrs:
        out["scale_shift"] = (scale_cols(w) // 4).bit_length() - 1
    if "kv_a" in a["io"] and t.index == 0:  # q absorption's first task: task_semantics_mla
        out.update(append=1, aux=_offset(program, op.inputs[3]), aux2=_view(program, op, "kv_a"),
                   eps=_f32_bits(a["eps"]), kcache=_offset(program, op.outputs[1]))
    return out


def _mla_attention(program: Program, t: Task, op) -> dict[str, int]:
    """One chunk of one head group: latent queries at `in`, q (for its rope part) at `aux`,
    the latent cache at `kcache`; the chunk results in mla_partials (`aux3`), which v
    expansion merges into the op's output; with DSA the chunk is of the indexer's selection,
    its token ids at `aux2`."""
    a = op.attrs
    return {"in": _offset(program, op.inputs[0]), "aux": _view(program, op, "q"),
            "kcache": _offset(program, op.inputs[2]),
            "scale": _f32_bits(a["scale"]), "count": a["tile"]["chunks"],
            "chunk": t.index % a["tile"]["chunks"], "aux3": _offset(program, "mla_partials"),
            **({"aux2": _offset(program, op.inputs[3])} if a["dsa"] else {})}


def _dsa_score(program: Program, t: Task, op) -> dict[str, int]:
    """One context chunk of the indexer's scores: its queries at `in`, head weights at `aux`,
    the step's unnormalized key at `aux2` (views of the projections), the key LayerNorm's
    weight at `aux3` and bias at `norm_bias`, the index key cache at `kcache`, scores at
    `out`."""
    a = op.attrs
    norm_w, norm_b, cache = op.inputs[-3:]
    return {"in": _view(program, op, "q"), "aux": _view(program, op, "w"),
            "aux2": _view(program, op, "k"), "aux3": _offset(program, norm_w),
            "norm_bias": _offset(program, norm_b), "kcache": _offset(program, cache),
            "out": _offset(program, op.outputs[0]), "eps": _f32_bits(a["eps"]),
            "count": a["tile"]["context_chunks"], "chunk": t.index}


def encode_task(program: Program, t: Task, counters: dict[str, int] | None = None,
                cols: tuple[str, ...] | None = None) -> list[int]:
    """One task's row; `encode` passes `counters` (counter_index) and `cols` (fields) so that
    they are not derived again for every task."""
    from tilertc.passes.tiling import ROUTED, is_tiled, stream_row_bytes

    op = program.graph.op(t.op)
    cols = cols or fields(program)
    row = dict.fromkeys(cols, 0)
    if "route" in row:
        row["route"] = -1
    if "selection_wait" in row:
        row["selection_wait"] = op.attrs.get("selection_wait", -1)
    if "fixed_out" in row:
        row.update(_fixed_fields(program, op))
    if "digits_in" in row:
        row.update(_digit_fields(program, op))
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
    if t.opcode in ("norm_matvec", "matvec_add", "head_matvec", "ffn_split_k", *ROUTED):
        weight = t.segments[0].tensor if t.segments else expert_weights(op)[0][0]
        row.update(
            # a MoE gate/up's rows are gate/up pairs, as a dense gate/up's with silu_mul
            epilogue=EPILOGUES[a.get("epilogue", "silu_mul" if t.opcode == "moe_gate_up"
                                     else "none")],
            k=a["K"],
            row_bytes=stream_row_bytes(program, op),
            w_format=WEIGHT_FORMATS["fp8_e4m3_tiles" if is_tiled(program, op)
                                    else program.graph.tensors[weight].dtype],
            w_lo=_low_bits(t.weight_offset // 16),
            w_hi=(t.weight_offset // 16) >> 32,
            # a norm_matvec may read a part of a concatenated output (MLA's q_b: the q_a part)
            **{"in": _offset(program, op.inputs[0]) + a.get("in_offset", 0)},
            out=_offset(program, op.outputs[0]),
        )
        if t.opcode == "head_matvec":
            row.update(_head_matvec(program, t, op))
        if t.opcode in ("norm_matvec", "moe_gate_up", "ffn_split_k"):
            row.update(aux=_offset(program, op.inputs[1]), eps=_f32_bits(a["eps"]))
        elif t.opcode == "matvec_add":
            row["aux"] = _offset(program, op.inputs[2])
        if t.opcode in ROUTED:
            row.update(_routed(program, t, op, counters or counter_index(program)))
        if t.opcode == "moe_down_add":
            row["aux"] = _offset(program, down_inputs(op)[4])
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
    elif t.opcode == "mla_attention":
        row.update(_mla_attention(program, t, op))
    elif t.opcode == "dsa_score":
        row.update(_dsa_score(program, t, op))
    elif t.opcode == "dsa_topk":
        row.update(**{"in": _offset(program, op.inputs[0])}, out=_offset(program, op.outputs[0]))
    elif t.opcode == "moe_topk":
        row.update(**{"in": _offset(program, op.inputs[0])}, out=_offset(program, op.outputs[0]),
                   aux=_offset(program, op.outputs[1]))
        if len(op.inputs) > 1:  # DeepSeek's correction bias
            row["aux2"] = _offset(program, op.inputs[1])
    elif t.opcode == "embed":
        row["out"] = _offset(program, op.outputs[0])
    elif t.opcode == "argmax":
        lm = next(o for o in program.graph.ops() if o.attrs.get("epilogue") == "argmax")
        row.update(**{"in": _offset(program, "argmax_partials")}, count=lm.attrs["tile"]["tasks"],
                   aux=_offset(program, "sample_partials"))
    if "xchg" in row:
        row.update(_exchange(program, t))
    return [row[f] for f in cols]


def _exchange(program: Program, t: Task) -> dict[str, int]:
    """A task's TP fields: its exchange counter and receive buffer (see TP_FIELDS)."""
    from tilertc.passes.residency import SAMPLE_EXCHANGE_FLOATS

    if t.exchange < 0:
        return {"xchg": -1}
    if t.opcode == "argmax":
        return {"xchg": t.exchange, "xchg_buf": _offset(program, "sample_exchange"),
                "xchg_stride": SAMPLE_EXCHANGE_FLOATS}
    return {"xchg": t.exchange, "xchg_buf": _offset(program, f"{t.op}.exchange"),
            "xchg_stride": program.graph.op(t.op).attrs["rows"]}
def _fixed_fields(program: Program, op) -> dict[str, int]:
    """FFN_FIELDS of any task of `op`: which of its inputs are fixed-point, and where a
    matvec_add writes the start value of a split-K FFN's sum."""
    def fixed(role: int) -> int:
        return int(program.graph.tensors[op.inputs[role]].dtype == "fx64")

    start = op.attrs.get("start_value")
    return {"fixed_in": fixed(0) if op.opcode == "norm_matvec" else 0,
            "fixed_res": fixed(2) if op.opcode == "matvec_add" else 0,
            "fixed_out": _offset(program, start) if start else -1}


def _digit_fields(program: Program, op) -> dict[str, int]:
    """DIGIT_FIELDS of any task of `op` (see there)."""
    reads = op.attrs.get("ready_digits")
    out = {"digits_in": _offset(program, f"{reads}.digits") if reads else -1,
           "digits_out": -1, "digits_gamma": -1}
    if "digits_for" in op.attrs:
        user = program.graph.op(op.attrs["digits_for"])
        out.update(digits_out=_offset(program, f"{user.name}.digits"), digits_k=user.attrs["K"])
        if normalizes(user):
            out["digits_gamma"] = _offset(program, user.inputs[1])
    return out


def counter_index(program: Program) -> dict[str, int]:
    return {c.name: i for i, c in enumerate(program.counters)}


def encode(program: Program) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tasks [n, fields] int32, stream offsets [ctas + 1] int32, stream task ids int32)."""
    counters, cols = counter_index(program), fields(program)
    tasks = np.array([encode_task(program, t, counters, cols) for t in program.tasks],
                     dtype=np.int32)
    offsets = np.cumsum([0] + [len(s) for s in program.streams]).astype(np.int32)
    ids = np.array([i for s in program.streams for i in s], dtype=np.int32)
    return tasks, offsets, ids
