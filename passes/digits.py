"""Ready digits: which FP8 tile tasks read their input as digits that its producer wrote.

An FP8 tile task multiplies its weights with its input as four e4m3 digits per column
(decode/tile_digits.cuh: stage_digits). Converting the input is instruction-bound and every SM that
runs a task of the op converts all of it: on an H200, 2.7 µs a task and ~0.68 ms of qwen3-32b's
12 ms token, all of it on the critical path (docs/performance.md, session 26). Where the input
is the whole output of one tiled dense projection, that projection's tasks can write the digits
of their own rows instead, once, beside the fp32 values, and the consumer only copies them in.

A block of 128 columns needs one exponent for the wgmma fold, but its rows come from several
producer tasks, and none knows the others' values. So a producer digitizes each 8 rows (a
group; tiled tasks own whole groups) with its own exponent rounded up to a multiple of 4: one
digit position. The consumer takes a block's largest group exponent and moves every other
group's digits down by whole digits: each value is kept to 2^-12 of its block's largest |x|
(stage_digits: 2^-16). A group's exponent and, where the consumer normalizes its input, its sum
of squares go into the same buffer (decode/ready_digits.cuh: put_ready_digits, stage_ready_digits).

Decides, unless the `ready_digits` knob is 0 (on by default wherever there are FP8 tiles: a
decode step was as fast or faster in every model measured, docs/performance.md, sessions 26-27;
knob 1 refuses a schedule without FP8 tiles): for each tiled `norm_matvec` / `matvec_add` /
`moe_gate_up` whose input is exactly the output of one tiled dense projection or MoE down
projection (`PRODUCERS`; the MoE down's output is the next layer's attention input), or, where
the `vexp_digits` knob asks, of MLA's v expansion (o_proj's input; tiling.py: writes_v_digits,
tasks of whole groups), at --tp 1, that the producer writes the digits (`digits_for`: the
first reader) and every tiled op that reads that output reads them (`ready_digits`: the same
name), when they all read it alike (a MoE layer's shared and routed gate/up: the same length
and norm weight; otherwise none does);
passes/residency.py gives each producer's digits one buffer, `<first reader>.digits`. The
schedule verifier (verify.py) sees the producer's fp32 output,
which it still writes and the consumer still waits for: the digits are written before the same
signal, so they are ordered as that output is.
"""

from __future__ import annotations

from tilertc.ir.fp8 import DIGIT_GROUP_ROWS
from tilertc.passes.program import Program, ScheduleError
from tilertc.passes.tiling import DENSE_PROJECTIONS, is_tiled, writes_v_digits

# the tiled projections whose output can be written as digits: the dense ones and the MoE down
# (a MoE layer's output, which the next layer's attention input projection normalizes)
PRODUCERS = (*DENSE_PROJECTIONS, "moe_down_add")


def normalizes(op) -> bool:
    """Whether tile op `op` normalizes its input (its digits then carry groups' sums of squares)."""
    return op.opcode in ("norm_matvec", "moe_gate_up")


def digits_floats(op) -> int:
    """fp32 words of a ready-digit consumer's buffer: 4 digit bytes per column, an int8
    exponent per group, and a normalizing consumer's per-group sums of squares."""
    k = op.attrs["K"]
    return k + k // DIGIT_GROUP_ROWS // 4 + (k // DIGIT_GROUP_ROWS if normalizes(op) else 0)


def _producer(program: Program, op):
    """The one tiled dense projection whose whole output `op` reads, and the tiled ops that
    read it (`op` among them), or None: where several do (a MoE layer's shared and routed
    gate/up), they must read it alike (the same length and norm weight), since they share one
    buffer of digits."""
    g = program.graph
    x = op.inputs[0]
    if op.attrs.get("in_offset"):
        return None
    src = [o for o in g.producers(op.name) if x in o.outputs]
    if len(src) != 1 or src[0].outputs[0] != x:
        return None
    src = src[0]
    if (not (src.opcode in PRODUCERS and is_tiled(program, src) or writes_v_digits(program, src))
            or src.attrs["rows"] != op.attrs["K"]):
        return None
    # (a matvec_add that adds x as its residual reads its fp32 values, which stay)
    readers = [o for o in g.consumers(src.name) if o.inputs[0] == x and is_tiled(program, o)]
    alike = all(normalizes(o) == normalizes(op) and o.attrs["K"] == op.attrs["K"]
                and (not normalizes(o) or o.inputs[1] == op.inputs[1]) for o in readers)
    return (src, readers) if op in readers and alike else None


def ready_digits(program: Program) -> Program:
    asked = program.config["tuning"].get("ready_digits")
    if program.config["tuning"].get("vexp_digits") and not any(
            writes_v_digits(program, op) for op in program.graph.ops()):
        raise ScheduleError("vexp_digits has MLA's v expansion write o_proj's input as digits: "
                            "it needs MLA attention, o_proj as FP8 tiles (--weight-dtype fp8, "
                            "--tp 1) and ready digits on")
    if asked is False:
        return program
    tiled = [op for op in program.graph.ops()
             if op.opcode in (*DENSE_PROJECTIONS, "moe_gate_up") and is_tiled(program, op)]
    if not tiled:
        if asked:
            raise ScheduleError("ready_digits has the producers of FP8 tile tasks' inputs "
                                "write their digits: it needs FP8 tiles (--weight-dtype fp8, "
                                "--tp 1, the cuda backend, fp8_mma not 0)")
        return program
    pairs = []
    for op in tiled:
        found = _producer(program, op)
        if found is None:
            continue
        src, readers = found
        if any((t.rows[1] - t.rows[0]) % DIGIT_GROUP_ROWS or t.rows[0] % DIGIT_GROUP_ROWS
               for t in program.tasks_of(src.name)):
            raise ScheduleError(f"op {src.name!r}: a task's rows are not whole groups of "
                                f"{DIGIT_GROUP_ROWS}, which ready digits need")
        # one buffer, named after its first reader, which the producer writes for all
        src.attrs["digits_for"] = readers[0].name
        op.attrs["ready_digits"] = readers[0].name
        pairs.append(f"{src.name} -> {op.name}")
    program.decide("digits", f"{len(pairs)} FP8 tile inputs made as digits by their producer"
                   + (f" ({pairs[0]}, ...)" if pairs else ""))
    return program
