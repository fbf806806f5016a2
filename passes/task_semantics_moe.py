"""Tile semantics of the MoE fused opcodes (see task_semantics.py for the contract).

- `moe_topk`: the interpreter's routing (`ir/moe.py` `route`) on the router logits; under
  expert parallelism (a shard of the experts, `local_experts`) the chosen experts of the shard,
  best first, as indices among its experts in slots [0, n), and id -1 with weight 0 in the
  slots after them (the kernel's route_local).
- `moe_gate_up` task of slot j, rows [r0, r1) of it: the norm prologue, then `linear` on those
  rows of the gate and up projections of the expert the slot holds, and `silu_mul`; nothing
  when the slot holds none (id -1).
- `moe_down_add` task of rows [r0, r1): Σ_j weight_j · `linear`(act_j, down rows of slot j's
  expert) over the slots that hold one, plus the shared expert's down rows, plus the residual
  (`add`s of the block).
"""

from __future__ import annotations

import torch

from tilertc.ir.moe import route
from tilertc.passes.fusion_moe import down_inputs
from tilertc.passes.program import Program, Task
from tilertc.passes.task_semantics import (
    KINDS,
    LINEAR,
    Access,
    Context,
    TaskKind,
    normed_input,
    read,
    run,
    sources,
    write,
)


def _topk_accesses(program: Program, t: Task, pos: int) -> list[Access]:
    op = program.graph.op(t.op)
    k = op.attrs.get("slots", op.attrs["top_k"])
    return [read(op.inputs[0], 0, op.attrs["num_experts"]),
            write(op.outputs[0], 0, k), write(op.outputs[1], 0, k)]


def _topk(ctx: Context, t: Task) -> None:
    op = ctx.program.graph.op(t.op)
    logits = ctx.read(op.inputs[0], 0, op.attrs["num_experts"])[None]
    bias = ctx.weight(op.inputs[1]) if len(op.inputs) > 1 else None
    ids, weights = local_routes(*route(logits, bias, op.attrs), op.attrs)
    ctx.write(op.outputs[0], 0, ids)
    ctx.write(op.outputs[1], 0, weights)


def local_routes(ids: torch.Tensor, weights: torch.Tensor,
                 attrs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """One token's routing ([1, top_k] ids and weights) as the shard `local_experts` = [lo, hi)
    keeps it: its chosen experts best first as indices from lo, then id -1 and weight 0 up to
    `slots`; the whole routing when the shard holds every expert."""
    lo, hi = attrs.get("local_experts", (0, attrs["num_experts"]))
    if (lo, hi) == (0, attrs["num_experts"]):
        return ids[0], weights[0]
    here = (ids[0] >= lo) & (ids[0] < hi)
    slots = attrs.get("slots", attrs["top_k"])
    out_ids = torch.full((slots,), -1, dtype=ids.dtype)
    out_w = torch.zeros(slots, dtype=weights.dtype)
    n = int(here.sum())
    out_ids[:n], out_w[:n] = ids[0][here] - lo, weights[0][here]
    return out_ids, out_w


KINDS["moe_topk"] = TaskKind(_topk_accesses, _topk)


def _expert(attrs: dict, ids: torch.Tensor, slot: int) -> int:
    """The slot's expert as an index among this rank's experts (-1: none of them)."""
    return int(ids[slot])


def _gate_up_accesses(program: Program, t: Task, pos: int) -> list[Access]:
    op = program.graph.op(t.op)
    slot = t.rows[0] // op.attrs["intermediate_size"]
    return [read(op.inputs[0], 0, op.attrs["K"]), read(op.inputs[2], slot, slot + 1),
            write(op.outputs[0], *t.rows)]


def _gate_up(ctx: Context, t: Task) -> None:
    op = ctx.program.graph.op(t.op)
    inter = op.attrs["intermediate_size"]
    slot = t.rows[0] // inter
    r0, r1 = t.rows[0] - slot * inter, t.rows[1] - slot * inter
    e = _expert(op.attrs, ctx.read(op.inputs[2], slot, slot + 1), 0)
    if e < 0:
        return
    xn = normed_input(ctx, op)
    gate, up = (ctx.weight(w)[r0:r1] for w in op.inputs[3 + 2 * e:5 + 2 * e])
    halves = [run("linear", LINEAR, [xn, w], ctx) for w in (gate, up)]
    ctx.write(op.outputs[0], t.rows[0], run("silu_mul", LINEAR, halves, ctx)[0])


KINDS["moe_gate_up"] = TaskKind(_gate_up_accesses, _gate_up)


def _down_accesses(program: Program, t: Task, pos: int) -> list[Access]:
    op = program.graph.op(t.op)
    a = op.attrs
    act, ids, weights, shared_act, residual, _, _ = down_inputs(op)
    out = [read(act, 0, a["slots"] * a["intermediate_size"]), read(ids, 0, a["slots"]),
           read(weights, 0, a["slots"])]
    if shared_act:
        out.append(read(shared_act, 0, a["shared_intermediate"]))
    return out + [read(residual, *t.rows), write(op.outputs[0], *t.rows)]


def _down(ctx: Context, t: Task) -> None:
    op = ctx.program.graph.op(t.op)
    a = op.attrs
    act, ids, weights, shared_act, residual, downs, shared_down = down_inputs(op)
    r0, r1, inter = *t.rows, a["intermediate_size"]
    chosen = ctx.read(ids, 0, a["slots"])
    scale = ctx.read(weights, 0, a["slots"])
    hidden = ctx.read(act, 0, a["slots"] * inter).reshape(a["slots"], inter)
    y = sum(run("linear", LINEAR, [hidden[j][None],
                                   ctx.weight(downs[_expert(a, chosen, j)])[r0:r1]], ctx)
            * scale[j] for j in range(a["slots"]) if _expert(a, chosen, j) >= 0)
    y = y if torch.is_tensor(y) else torch.zeros(1, r1 - r0)  # no slot holds an expert here
    adds = [o for o in sources(ctx, op) if o.opcode == "add"]  # [combine,] residual
    if shared_down:
        shared = run("linear", LINEAR, [ctx.read(shared_act, 0, a["shared_intermediate"])[None],
                                        ctx.weight(shared_down)[r0:r1]], ctx)
        y = run("add", adds[0], [y, shared], ctx)
    res = ctx.read(residual, r0, r1)[None]
    ctx.write(op.outputs[0], r0, run("add", adds[-1], [res, y], ctx)[0])


KINDS["moe_down_add"] = TaskKind(_down_accesses, _down)
