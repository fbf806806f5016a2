"""Tile semantics: what one task of each fused opcode reads, writes and computes.

The schedule verifier (`verify.py`) needs every task described twice, and the two must agree:

- `accesses(program, task, pos)`: the buffer regions the task reads and writes, in the order
  the kernel does them. The verifier derives dependencies and hazards from these alone, so
  they are all it needs for a full-size model.
- `compute(ctx, task)`: the task's numbers. It reads and writes only through `ctx`, which
  refuses any region the task did not declare, and it computes by calling the interpreter's
  semantics (`ir/interpreter.py` SEMANTICS) of the fused op's constituent ops on the task's
  slice: a task of rows [r0, r1) runs `linear` on those weight rows, an attention chunk runs
  `rope`/`head_rms_norm`/`kv_append`/`attention` on its KV group's heads with the attrs sliced
  to match. The only math here that the interpreter does not have is the merge of context
  chunks (log-sum-exp weights).

A split-K FFN's tasks *add* into their output (`accumulate` accesses) rather than write it:
the output is a fixed-point buffer (`fx64`) whose start value another op writes, and a reader
must see that write and every task's add (the kernel adds integers, so the order does not
matter). Reads of fixed-point buffers give their fp32 values (`read_value`).

Ops whose tasks arrive on a per-group counter (chunked attention) are merged by whichever
chunk of a group arrives last; that merge is described by `merge_accesses` and `merge_compute`.

Buffers are the graph's tensors by name, plus the program's scratch buffers and `tokens` (row p
holds the input token of position p: the host writes the first, the argmax of position p - 1
each next one, as the kernel keeps them). Per-step buffers are flat; KV caches and `tokens` are
row buffers (one row per position) accessed by row range.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from tilertc.ir.graph import Op
from tilertc.ir.interpreter import SEMANTICS, Step
from tilertc.passes.program import Program, Task


class Access(NamedTuple):
    """Elements [lo, hi) of `buffer` (of each row in `rows`, for row buffers); a write with
    `add` adds to what is there (after the region's start value was written)."""

    write: bool
    buffer: str
    lo: int
    hi: int
    rows: tuple[int, int] | None = None
    add: bool = False


def read(buffer: str, lo: int, hi: int, rows: tuple[int, int] | None = None) -> Access:
    return Access(False, buffer, lo, hi, rows)


def write(buffer: str, lo: int, hi: int, rows: tuple[int, int] | None = None) -> Access:
    return Access(True, buffer, lo, hi, rows)


def accumulate(buffer: str, lo: int, hi: int) -> Access:
    return Access(True, buffer, lo, hi, None, True)


class Context(Protocol):
    """What `compute` may use: the verifier's memory, the weights, the unfused graph."""

    program: Program
    pos: int
    step: int
    istep: Step  # the interpreter's view of the step: positions [pos]

    def read(self, buffer: str, lo: int, hi: int,
             rows: tuple[int, int] | None = None) -> torch.Tensor: ...

    def write(self, buffer: str, lo: int, values: torch.Tensor, row: int | None = None) -> None: ...

    def add(self, buffer: str, lo: int, values: torch.Tensor) -> None: ...

    def weight(self, name: str) -> torch.Tensor: ...

    def source(self, name: str) -> Op: ...


Accesses = Callable[[Program, Task, int], list[Access]]
Compute = Callable[[Context, Task], None]
MergeAccesses = Callable[[Program, Op, int, int], list[Access]]
MergeCompute = Callable[[Context, Op, int], None]


@dataclass(frozen=True)
class TaskKind:
    accesses: Accesses
    compute: Compute
    merge_accesses: MergeAccesses | None = None
    merge_compute: MergeCompute | None = None


KINDS: dict[str, TaskKind] = {}


def run(opcode: str, op: Op, ins: list[torch.Tensor], ctx: Context,
        **attrs: object) -> torch.Tensor:
    """The interpreter's semantics of `opcode` on `op` with some attrs replaced (a slice)."""
    if attrs:
        op = dataclasses.replace(op, attrs={**op.attrs, **attrs})
    return SEMANTICS[opcode](op, ins, ctx.istep)[0]


def sources(ctx: Context, op: Op) -> list[Op]:
    return [ctx.source(n) for n in op.attrs["fused_from"]]


def source(ctx: Context, op: Op, opcode: str) -> Op:
    """The constituent op of `op` with `opcode` (the first, if several)."""
    return next(o for o in sources(ctx, op) if o.opcode == opcode)


# `linear` semantics do not depend on the op: this one stands for the projections a fused op
# folds in (including a router's, whose op is `moe_router`).
LINEAR = Op("linear", "linear", (), ())


# -- embed and argmax ----------------------------------------------------------------------------

def _embed_accesses(program: Program, t: Task, pos: int) -> list[Access]:
    op = program.graph.op(t.op)
    return [read("tokens", 0, 1, (pos, pos + 1)),
            write(op.outputs[0], 0, program.graph.tensors[op.outputs[0]].numel)]


def _embed(ctx: Context, t: Task) -> None:
    op = ctx.program.graph.op(t.op)
    ids = ctx.read("tokens", 0, 1, (ctx.pos, ctx.pos + 1)).reshape(1).long()
    y = run("embedding", sources(ctx, op)[0], [ids, ctx.weight(op.inputs[1])], ctx)
    ctx.write(op.outputs[0], 0, y[0])


def lm_head_tasks(program: Program) -> int:
    """Tasks of the op with the argmax epilogue: each leaves a (max, row) pair for `argmax`."""
    return next(op.attrs["tile"]["tasks"] for op in program.graph.ops()
                if op.attrs.get("epilogue") == "argmax")


def _argmax_accesses(program: Program, t: Task, pos: int) -> list[Access]:
    op = program.graph.op(t.op)
    return [read("argmax_partials", 0, 2 * lm_head_tasks(program)),
            write(op.outputs[0], 0, 1), write("tokens", 0, 1, (pos + 1, pos + 2))]


def _argmax(ctx: Context, t: Task) -> None:
    op = ctx.program.graph.op(t.op)
    parts = ctx.read("argmax_partials", 0, 2 * lm_head_tasks(ctx.program)).reshape(-1, 2)
    best = run("argmax", sources(ctx, op)[0], [parts[None, :, 0]], ctx)
    token = parts[best.reshape(()), 1].reshape(1)
    ctx.write(op.outputs[0], 0, token)
    ctx.write("tokens", 0, token, row=ctx.pos + 1)


KINDS["embed"] = TaskKind(_embed_accesses, _embed)
KINDS["argmax"] = TaskKind(_argmax_accesses, _argmax)


# -- fixed-point buffers (a split-K FFN's sum) ----------------------------------------------

def to_fixed(x: torch.Tensor, bits: int) -> torch.Tensor:
    """fp32 values as the kernel's fixed point: x * 2^bits (exact) rounded to nearest even."""
    return torch.round(x.to(torch.float32) * 2.0**bits).to(torch.int64)


def from_fixed(v: torch.Tensor, bits: int) -> torch.Tensor:
    """Fixed-point values as fp32: rounded to fp32, then scaled by 2^-bits (exact)."""
    return v.to(torch.float32) * 2.0**-bits


def frac_bits(program: Program, buffer: str) -> int | None:
    """The fraction bits of a fixed-point buffer, None for any other."""
    t = program.graph.tensors.get(buffer)
    return t.attrs["frac_bits"] if t is not None and t.dtype == "fx64" else None


def read_value(ctx: Context, buffer: str, lo: int, hi: int) -> torch.Tensor:
    """Elements [lo, hi) of a buffer as fp32 (a fixed-point buffer's converted)."""
    bits = frac_bits(ctx.program, buffer)
    v = ctx.read(buffer, lo, hi)
    return v if bits is None else from_fixed(v, bits)


# -- matrix-vector tasks -----------------------------------------------------------------------

def _matvec_accesses(program: Program, t: Task, pos: int) -> list[Access]:
    op = program.graph.op(t.op)
    r0, r1 = t.rows
    x0 = op.attrs.get("in_offset", 0)
    out = [read(op.inputs[0], x0, x0 + op.attrs["K"])]
    if op.opcode == "matvec_add":
        out.append(read(op.inputs[2], r0, r1))
    out.append(write(op.outputs[0], r0, r1))
    if "start_value" in op.attrs:  # of a split-K FFN's sum
        out.append(write(op.attrs["start_value"], r0, r1))
    if op.attrs.get("epilogue") == "argmax":
        out.append(write("argmax_partials", 2 * t.index, 2 * t.index + 2))
    return out


def _segment_products(ctx: Context, t: Task, x: torch.Tensor) -> list[torch.Tensor]:
    """x · W[rows]ᵀ for each weight segment of the task."""
    return [run("linear", LINEAR, [x, ctx.weight(s.tensor)[s.row0:s.row1]], ctx)
            for s in t.segments]


def normed_input(ctx: Context, op: Op) -> torch.Tensor:
    """The input vector of a task with a norm prologue, normalized: [1, K]."""
    x0 = op.attrs["in_offset"]
    x = read_value(ctx, op.inputs[0], x0, x0 + op.attrs["K"])[None]
    return run("rms_norm", source(ctx, op, "rms_norm"), [x, ctx.weight(op.inputs[1])], ctx)


def _norm_matvec(ctx: Context, t: Task) -> None:
    op = ctx.program.graph.op(t.op)
    ys = _segment_products(ctx, t, normed_input(ctx, op))
    if op.attrs["epilogue"] == "silu_mul":
        y = run("silu_mul", source(ctx, op, "silu_mul"), ys, ctx)
    else:
        y = torch.cat(ys, dim=-1)
    ctx.write(op.outputs[0], t.rows[0], y[0])
    if op.attrs["epilogue"] == "argmax":
        sampler = next(o for o in ctx.program.graph.ops() if o.opcode == "argmax")
        i = int(run("argmax", ctx.source(sampler.attrs["fused_from"][0]), [y], ctx))
        ctx.write("argmax_partials", 2 * t.index, torch.tensor([y[0, i], t.rows[0] + i]))


def _matvec_add(ctx: Context, t: Task) -> None:
    op = ctx.program.graph.op(t.op)
    x = ctx.read(op.inputs[0], 0, op.attrs["K"])[None]
    (y,) = _segment_products(ctx, t, x)
    res = read_value(ctx, op.inputs[2], *t.rows)[None]
    out = run("add", source(ctx, op, "add"), [res, y], ctx)[0]
    ctx.write(op.outputs[0], t.rows[0], out)
    start = op.attrs.get("start_value")
    if start:
        ctx.write(start, t.rows[0], to_fixed(out, frac_bits(ctx.program, start)))


KINDS["norm_matvec"] = TaskKind(_matvec_accesses, _norm_matvec)
KINDS["matvec_add"] = TaskKind(_matvec_accesses, _matvec_add)


# -- a dense MLP as one split-K op -------------------------------------------------------------
# Task i owns intermediate columns [c0, c1): gate/up rows of the slice, silu_mul, then the
# slice's columns of W_down; its partial sum of every output row is added (in fixed point) onto
# the start value the op before wrote.

def _split_k_accesses(program: Program, t: Task, pos: int) -> list[Access]:
    op = program.graph.op(t.op)
    out = op.outputs[0]
    return [read(op.inputs[0], 0, op.attrs["K"]),
            accumulate(out, 0, program.graph.tensors[out].numel)]


def _split_k(ctx: Context, t: Task) -> None:
    op = ctx.program.graph.op(t.op)
    gate, up, down = t.segments
    c0, c1 = down.cols
    g, u = _segment_products(ctx, dataclasses.replace(t, segments=[gate, up]),
                             normed_input(ctx, op))
    h = run("silu_mul", source(ctx, op, "silu_mul"), [g, u], ctx)
    y = run("linear", LINEAR, [h, ctx.weight(down.tensor)[:, c0:c1]], ctx)
    ctx.add(op.outputs[0], 0, to_fixed(y[0], frac_bits(ctx.program, op.outputs[0])))


KINDS["ffn_split_k"] = TaskKind(_split_k_accesses, _split_k)


# -- chunked attention -----------------------------------------------------------------------
# Task g * chunks + c covers context chunk c of KV group g; the chunk bounds follow the
# context at run time as in the kernel. The last chunk of a group holds the current position:
# it alone prepares the new key and value and appends them. Each chunk leaves, per query head,
# its normalized output and the log-sum-exp of its scores in `attn_partials` (the same place
# and size as the kernel's partials); the group's merge weighs them.

def chunk_bounds(pos: int, chunk: int, chunks: int) -> tuple[int, int]:
    """Rows [k0, k1) of chunk `chunk` of a context of pos + 1 rows, as the kernel cuts it."""
    n = pos + 1
    return n * chunk // chunks, n * (chunk + 1) // chunks


def chunk_result(heads: int, width: int, out: torch.Tensor | None = None,
                 scores: torch.Tensor | None = None) -> torch.Tensor:
    """A chunk's partial result per head: [normalized output (width), log-sum-exp of its
    scores, unused]; an empty chunk has a log-sum-exp of -inf and weighs nothing."""
    result = torch.zeros(heads, width + 2)
    result[:, width] = float("-inf")
    if out is not None:
        result[:, :width] = out.reshape(heads, width)
        result[:, width] = scores.logsumexp(-1)
    return result.reshape(-1)


def merge_chunks(ctx: Context, buffer: str, base: int, chunks: int, heads: int,
                 width: int) -> torch.Tensor:
    """The merged output [heads * width] of `chunks` partial results at `base`."""
    parts = ctx.read(buffer, base, base + chunks * heads * (width + 2))
    parts = parts.reshape(chunks, heads, width + 2)
    weights = parts[:, :, width].softmax(0)  # [chunks, heads]
    return (weights[..., None] * parts[:, :, :width]).sum(0).reshape(-1)


Geometry = Callable[[Op], tuple[int, int, int, int]]


def chunk_merge(geometry: Geometry, partials: str) -> tuple[MergeAccesses, MergeCompute]:
    """The merge of one group of a chunked attention op: every chunk's partial result, laid out
    group by group in the scratch buffer `partials`, into the group's rows of the op's output.
    `geometry(op)` gives (heads per group, output width per head, chunks, floats of one chunk's
    partial result)."""

    def accesses(program: Program, op: Op, g: int, pos: int) -> list[Access]:
        heads, width, chunks, part = geometry(op)
        return [read(partials, g * chunks * part, (g + 1) * chunks * part),
                write(op.outputs[0], g * heads * width, (g + 1) * heads * width)]

    def compute(ctx: Context, op: Op, g: int) -> None:
        heads, width, chunks, part = geometry(op)
        out = merge_chunks(ctx, partials, g * chunks * part, chunks, heads, width)
        ctx.write(op.outputs[0], g * heads * width, out)

    return accesses, compute


def _attention_geometry(op: Op) -> tuple[int, int, int, int]:
    """(query heads per group, head dim, chunks, floats of one chunk's partial result)."""
    a = op.attrs
    group, hd = a["n_heads"] // a["n_kv_heads"], a["head_dim"]
    return group, hd, a["tile"]["chunks"], group * (hd + 2)


def _attention_accesses(program: Program, t: Task, pos: int) -> list[Access]:
    op = program.graph.op(t.op)
    a = op.attrs
    group, hd, chunks, part = _attention_geometry(op)
    g, c = t.rows[0], t.index % chunks
    qkv, (kc, vc) = op.inputs[0], op.inputs[-2:]
    out = [read(qkv, g * group * hd, (g + 1) * group * hd)]
    if c == chunks - 1:
        nh, nkv = a["n_heads"], a["n_kv_heads"]
        out += [read(qkv, (nh + g) * hd, (nh + g + 1) * hd),
                read(qkv, (nh + nkv + g) * hd, (nh + nkv + g + 1) * hd),
                write(kc, g * hd, (g + 1) * hd, (pos, pos + 1)),
                write(vc, g * hd, (g + 1) * hd, (pos, pos + 1))]
    k0, k1 = chunk_bounds(pos, c, chunks)
    if k1 > k0:
        out += [read(kc, g * hd, (g + 1) * hd, (k0, k1)), read(vc, g * hd, (g + 1) * hd, (k0, k1))]
    base = (g * chunks + c) * part
    return out + [write("attn_partials", base, base + part)]


def _attention_sources(ctx: Context, op: Op) -> dict[str, Op]:
    """The constituent ops by role, found by data flow: `q_rope` feeds attention, `k_rope`
    feeds kv_append, and each `*_norm` (qk-norm) feeds its rope."""
    src = sources(ctx, op)
    writer = {t: o for o in src for t in o.outputs}
    roles = {o.opcode: o for o in src if o.opcode in ("kv_append", "attention")}
    roles["q_rope"] = writer[roles["attention"].inputs[0]]
    roles["k_rope"] = writer[roles["kv_append"].inputs[0]]
    for r in ("q", "k"):
        if roles[f"{r}_rope"].inputs[0] in writer:
            roles[f"{r}_norm"] = writer[roles[f"{r}_rope"].inputs[0]]
    return roles


def _attention(ctx: Context, t: Task) -> None:
    op = ctx.program.graph.op(t.op)
    a = op.attrs
    group, hd, chunks, part = _attention_geometry(op)
    g, c = t.rows[0], t.index % chunks
    src = _attention_sources(ctx, op)
    qkv, (kc, vc) = op.inputs[0], op.inputs[-2:]
    pos = torch.tensor([ctx.pos])

    def prologue(x: torch.Tensor, role: str, heads: int) -> torch.Tensor:
        if a["qk_norm"]:
            norm = src[f"{role}_norm"]
            x = run("head_rms_norm", norm, [x, ctx.weight(norm.inputs[1])], ctx, n_heads=heads)
        return run("rope", src[f"{role}_rope"], [x, pos], ctx, n_heads=heads)

    q = prologue(ctx.read(qkv, g * group * hd, (g + 1) * group * hd)[None], "q", group)
    if c == chunks - 1:
        nh, nkv = a["n_heads"], a["n_kv_heads"]
        k = prologue(ctx.read(qkv, (nh + g) * hd, (nh + g + 1) * hd)[None], "k", 1)
        v = ctx.read(qkv, (nh + nkv + g) * hd, (nh + nkv + g + 1) * hd)[None]
        rows = {name: torch.zeros(ctx.pos + 1, 1, hd) for name in (kc, vc)}
        append = dataclasses.replace(src["kv_append"], outputs=(kc, vc))
        SEMANTICS["kv_append"](append, [k, v, pos], Step(pos, rows, ctx.istep.dtype))
        for name in (kc, vc):
            ctx.write(name, g * hd, rows[name][ctx.pos].reshape(-1), row=ctx.pos)
    k0, k1 = chunk_bounds(ctx.pos, c, chunks)
    result = chunk_result(group, hd)
    if k1 > k0:
        keys = ctx.read(kc, g * hd, (g + 1) * hd, (k0, k1)).reshape(k1 - k0, 1, hd)
        values = ctx.read(vc, g * hd, (g + 1) * hd, (k0, k1)).reshape(k1 - k0, 1, hd)
        sliced = dataclasses.replace(src["attention"], attrs={**src["attention"].attrs,
                                                              "n_heads": group, "n_kv_heads": 1})
        o = SEMANTICS["attention"](sliced, [q, keys, values, pos], chunk_step(ctx, k1 - k0))[0]
        scores = torch.einsum("hd,nd->hn", q.reshape(group, hd), keys[:, 0]) * a["scale"]
        result = chunk_result(group, hd, o, scores)
    ctx.write("attn_partials", (g * chunks + c) * part, result)


def chunk_step(ctx: Context, rows: int) -> Step:
    """The interpreter's step for attention over `rows` gathered cache rows, all visible."""
    return Step(torch.tensor([rows - 1]), {}, ctx.istep.dtype)


KINDS["attention"] = TaskKind(_attention_accesses, _attention,
                              *chunk_merge(_attention_geometry, "attn_partials"))
