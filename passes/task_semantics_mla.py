"""Tile semantics of the MLA and DSA fused opcodes (see task_semantics.py for the contract).

- `head_matvec` rows [r0, r1) cover heads h0..h1: the task runs the interpreter's
  `mla_absorb_q` (or `mla_expand_v`) on those heads' inputs and kv_b rows, and keeps its rows.
  Task 0 of the absorb op also runs the latent prologue (`split`, `rms_norm`, `rope`) and
  appends the step's latent row with `mla_kv_append`. The expand op (`merges`) takes its
  heads' inputs as the merge of the attention's chunk results in `mla_partials`, and writes
  the heads whose first row it holds to the attention's output.
- `mla_attention` task g * chunks + c: heads [g·G, (g+1)·G), chunk c of the context (of the
  top-k list with DSA, whose rows it gathers, unless the list is every token: then, as the
  kernel, the chunk's cache rows without reading the list); `rope` on its queries, then
  `mla_attention` on the chunk's rows; partial results in `mla_partials`, merged by the expand
  op's tasks.
- `dsa_score` task c: `rope` on the indexer queries, `dsa_index_score` on chunk c; the last
  chunk runs `layer_norm` and `rope` on the new key and appends it with `kv_append`.
- `dsa_topk`: `dsa_topk` on the visible scores.
"""

from __future__ import annotations

import dataclasses

import torch

from tilertc.ir.graph import Op
from tilertc.ir.interpreter import SEMANTICS, Step
from tilertc.ir.mla import q_heads
from tilertc.passes.program import Program, Task
from tilertc.passes.synchronization import selects_every_token
from tilertc.passes.task_semantics import (
    KINDS,
    Access,
    Context,
    TaskKind,
    chunk_bounds,
    chunk_result,
    chunk_step,
    merge_chunks,
    read,
    run,
    source,
    sources,
    write,
)


def _appended_row(ctx: Context, append: Op, ins: list[torch.Tensor], width: int) -> torch.Tensor:
    """The cache row an append op writes at the current position (run on a scratch cache)."""
    pos = torch.tensor([ctx.pos])
    scratch = {append.outputs[0]: torch.zeros(ctx.pos + 1, width)}
    SEMANTICS[append.opcode](append, [*ins, pos], Step(pos, scratch, ctx.istep.dtype))
    return scratch[append.outputs[0]][ctx.pos]


# -- head_matvec: q absorption and v expansion -------------------------------------------------

def _heads(op: Op, t: Task) -> tuple[int, int]:
    per = op.attrs["rows_per_head"]
    return t.rows[0] // per, -(-t.rows[1] // per)


def _first_rows_held(op: Op, t: Task) -> tuple[int, int]:
    """The heads whose first row the task holds (v expansion writes those to o_latent)."""
    return -(-t.rows[0] // op.attrs["rows_per_head"]), _heads(op, t)[1]


def _head_matvec_accesses(program: Program, t: Task, pos: int) -> list[Access]:
    op = program.graph.op(t.op)
    a = op.attrs
    h0, h1 = _heads(op, t)
    if "merges" in a:  # every chunk's result of the head groups the task's heads are in
        heads, _, chunks, part = _mla_geometry(program.graph.op(a["merges"]))
        out = [read("mla_partials", h0 // heads * chunks * part, -(-h1 // heads) * chunks * part)]
        first, last = _first_rows_held(op, t)
        if first < last:
            out.append(write(op.inputs[0], first * a["K"], last * a["K"]))
    else:
        base, off = a["io"]["x"]
        out = [read(base, off + h0 * a["in_stride"], off + h1 * a["in_stride"])]
    if "kv_a" in a["io"] and t.index == 0:
        kv, kv_off = a["io"]["kv_a"]
        width = a["kv_lora_rank"] + a["qk_rope_head_dim"]
        out += [read(kv, kv_off, kv_off + width), write(op.outputs[1], 0, width, (pos, pos + 1))]
    return out + [write(op.outputs[0], *t.rows)]


def _head_matvec(ctx: Context, t: Task) -> None:
    op = ctx.program.graph.op(t.op)
    a = op.attrs
    h0, h1 = _heads(op, t)
    main = next(o for o in sources(ctx, op) if o.opcode in ("mla_absorb_q", "mla_expand_v"))
    if "merges" in a:
        x = _merged_heads(ctx, ctx.program.graph.op(a["merges"]), h0, h1)[None]
        first, last = _first_rows_held(op, t)
        if first < last:
            ctx.write(op.inputs[0], first * a["K"], x[0, (first - h0) * a["K"]:])
    else:
        base, off = a["io"]["x"]
        x = ctx.read(base, off + h0 * a["in_stride"], off + h1 * a["in_stride"])[None]
    per_head = a["qk_nope_head_dim"] + a["v_head_dim"]
    kv_b = ctx.weight(main.inputs[1])[h0 * per_head:h1 * per_head]
    y = run(main.opcode, main, [x, kv_b], ctx, n_heads=h1 - h0)[0]
    first = h0 * a["rows_per_head"]
    ctx.write(op.outputs[0], t.rows[0], y[t.rows[0] - first:t.rows[1] - first])
    if "kv_a" in a["io"] and t.index == 0:
        _latent_prologue(ctx, op)


def _merged_heads(ctx: Context, attn: Op, h0: int, h1: int) -> torch.Tensor:
    """Heads h0..h1 of mla_attention `attn`'s output: each head group's chunk results merged."""
    heads, r, chunks, part = _mla_geometry(attn)
    groups = [merge_chunks(ctx, "mla_partials", g * chunks * part, chunks, heads, r)
              for g in range(h0 // heads, -(-h1 // heads))]
    first = h0 // heads * heads
    return torch.cat(groups)[(h0 - first) * r:(h1 - first) * r]


def _latent_prologue(ctx: Context, op: Op) -> None:
    """Split kv_a, normalize the latent, rotate k_pe, append the row to the latent cache."""
    a = op.attrs
    kv, kv_off = a["io"]["kv_a"]
    width = a["kv_lora_rank"] + a["qk_rope_head_dim"]
    split = source(ctx, op, "split")
    latent, k_pe = SEMANTICS["split"](split, [ctx.read(kv, kv_off, kv_off + width)[None]],
                                      ctx.istep)
    norm = source(ctx, op, "rms_norm")
    latent = run("rms_norm", norm, [latent, ctx.weight(norm.inputs[1])], ctx)
    k_pe = run("rope", source(ctx, op, "rope"), [k_pe, torch.tensor([ctx.pos])], ctx)
    row = _appended_row(ctx, source(ctx, op, "mla_kv_append"), [latent, k_pe], width)
    ctx.write(op.outputs[1], 0, row, row=ctx.pos)


KINDS["head_matvec"] = TaskKind(_head_matvec_accesses, _head_matvec)


# -- mla_attention -----------------------------------------------------------------------------

def _mla_geometry(op: Op) -> tuple[int, int, int, int]:
    """(heads per task, latent rank, chunks, floats of one chunk's partial result)."""
    a = op.attrs
    heads, r = a["tile"]["heads_per_task"], a["kv_lora_rank"]
    return heads, r, a["tile"]["chunks"], heads * (r + 2)


def _selected(program: Program, op: Op, pos: int) -> int:
    """Rows a query attends to: the context, or with DSA its top-k list's visible part."""
    n = pos + 1
    return min(n, program.graph.tensors[op.inputs[3]].numel) if op.attrs["dsa"] else n


@dataclasses.dataclass(frozen=True)
class _MLAChunk:
    """Where one mla_attention chunk task reads and writes: its heads' latent queries and
    q rows, the cache rows [k0, k1) of its chunk, its slot in the partials."""

    op: Op
    heads: int
    rank: int
    latent: tuple[int, int]  # element range of op.inputs[0]
    q: str
    q_range: tuple[int, int]
    cache: str
    width: int
    k0: int
    k1: int
    partial: tuple[int, int]  # element range of mla_partials


def _mla_chunk(program: Program, t: Task, pos: int) -> _MLAChunk:
    op = program.graph.op(t.op)
    a = op.attrs
    heads, r, chunks, part = _mla_geometry(op)
    g, c = t.rows[0], t.index % chunks
    qk = a["qk_nope_head_dim"] + a["qk_rope_head_dim"]
    q, q_off = a["io"]["q"]
    cache = op.inputs[2]
    k0, k1 = chunk_bounds(_selected(program, op, pos) - 1, c, chunks)
    base = (g * chunks + c) * part
    return _MLAChunk(op, heads, r, (g * heads * r, (g + 1) * heads * r), q,
                     (q_off + g * heads * qk, q_off + (g + 1) * heads * qk), cache,
                     program.graph.tensors[cache].shape[1], k0, k1, (base, base + part))


def _mla_attention_accesses(program: Program, t: Task, pos: int) -> list[Access]:
    ch = _mla_chunk(program, t, pos)
    out = [read(ch.op.inputs[0], *ch.latent), read(ch.q, *ch.q_range)]
    if ch.k1 > ch.k0:
        if ch.op.attrs["dsa"] and not selects_every_token(program, ch.op, pos):
            # which rows is known at run time: any visible one
            out += [read(ch.op.inputs[3], ch.k0, ch.k1), read(ch.cache, 0, ch.width, (0, pos + 1))]
        else:
            out.append(read(ch.cache, 0, ch.width, (ch.k0, ch.k1)))
    return out + [write("mla_partials", *ch.partial)]


def _mla_attention(ctx: Context, t: Task) -> None:
    ch = _mla_chunk(ctx.program, t, ctx.pos)
    op, a, heads, r, cache, width, k0, k1 = (ch.op, ch.op.attrs, ch.heads, ch.rank, ch.cache,
                                             ch.width, ch.k0, ch.k1)
    q_lat = ctx.read(op.inputs[0], *ch.latent)[None]
    q = ctx.read(ch.q, *ch.q_range)[None]
    q = run("rope", source(ctx, op, "rope"), [q, torch.tensor([ctx.pos])], ctx, n_heads=heads)
    result = chunk_result(heads, r)
    if k1 > k0:
        if a["dsa"] and not selects_every_token(ctx.program, op, ctx.pos):
            ids = ctx.read(op.inputs[3], k0, k1)
            ids = ids[ids >= 0]
            rows = ctx.read(cache, 0, width, (0, ctx.pos + 1))[ids]
        else:
            rows = ctx.read(cache, 0, width, (k0, k1))
        attn = source(ctx, op, "mla_attention")
        sliced = dataclasses.replace(attn, attrs={**attn.attrs, "n_heads": heads})
        step = chunk_step(ctx, len(rows))
        o = SEMANTICS["mla_attention"](sliced, [q_lat, q, rows, step.positions], step)[0]
        _, q_pe = q_heads(q, sliced.attrs)
        scores = (torch.einsum("hr,nr->hn", q_lat.reshape(heads, r), rows[:, :r]) +
                  torch.einsum("hd,nd->hn", q_pe[0], rows[:, r:])) * a["scale"]
        result = chunk_result(heads, r, o, scores)
    ctx.write("mla_partials", ch.partial[0], result)


KINDS["mla_attention"] = TaskKind(_mla_attention_accesses, _mla_attention)


# -- DSA indexer -------------------------------------------------------------------------------

def _dsa_score_accesses(program: Program, t: Task, pos: int) -> list[Access]:
    op = program.graph.op(t.op)
    a = op.attrs
    chunks, c = a["tile"]["context_chunks"], t.index
    (q, q_off), (k, k_off), (w, w_off) = (a["io"][r] for r in ("q", "k", "w"))
    d, cache = a["head_dim"], op.outputs[1]
    out = [read(q, q_off, q_off + a["n_heads"] * d), read(w, w_off, w_off + a["n_heads"])]
    if c == chunks - 1:
        out += [read(k, k_off, k_off + d), write(cache, 0, d, (pos, pos + 1))]
    k0, k1 = chunk_bounds(pos, c, chunks)
    if k1 > k0:
        out += [read(cache, 0, d, (k0, k1)), write(op.outputs[0], k0, k1)]
    return out


def _dsa_score(ctx: Context, t: Task) -> None:
    op = ctx.program.graph.op(t.op)
    a = op.attrs
    chunks, c = a["tile"]["context_chunks"], t.index
    (q, q_off), (k, k_off), (w, w_off) = (a["io"][r] for r in ("q", "k", "w"))
    d, cache = a["head_dim"], op.outputs[1]
    pos = torch.tensor([ctx.pos])
    src = sources(ctx, op)
    writer = {tensor: o for o in src for tensor in o.outputs}
    score = source(ctx, op, "dsa_index_score")
    append = source(ctx, op, "kv_append")
    q = run("rope", writer[score.inputs[0]], [ctx.read(q, q_off, q_off + a["n_heads"] * d)[None],
                                              pos], ctx)
    if c == chunks - 1:
        norm = source(ctx, op, "layer_norm")
        key = run("layer_norm", norm, [ctx.read(k, k_off, k_off + d)[None],
                                       *(ctx.weight(p) for p in norm.inputs[1:])], ctx)
        key = run("rope", writer[append.inputs[0]], [key, pos], ctx)
        ctx.write(cache, 0, _appended_row(ctx, append, [key], d), row=ctx.pos)
    k0, k1 = chunk_bounds(ctx.pos, c, chunks)
    if k1 > k0:
        keys = ctx.read(cache, 0, d, (k0, k1))
        step = chunk_step(ctx, k1 - k0)
        weights = ctx.read(w, w_off, w_off + a["n_heads"])[None]
        scores = SEMANTICS["dsa_index_score"](score, [q, weights, keys, step.positions], step)[0]
        ctx.write(op.outputs[0], k0, scores[0])


KINDS["dsa_score"] = TaskKind(_dsa_score_accesses, _dsa_score)


def _dsa_topk_accesses(program: Program, t: Task, pos: int) -> list[Access]:
    op = program.graph.op(t.op)
    return [read(op.inputs[0], 0, pos + 1), write(op.outputs[0], 0, op.attrs["topk"])]


def _dsa_topk(ctx: Context, t: Task) -> None:
    op = ctx.program.graph.op(t.op)
    scores = ctx.read(op.inputs[0], 0, ctx.pos + 1)[None]
    ctx.write(op.outputs[0], 0, run("dsa_topk", source(ctx, op, "dsa_topk"), [scores], ctx)[0])


KINDS["dsa_topk"] = TaskKind(_dsa_topk_accesses, _dsa_topk)
