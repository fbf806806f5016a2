"""Fusion of a mixture-of-experts block: router, routed experts, shared expert, residual.

The post-attention norm feeds the router, the routed experts and the shared expert. Each gets
the norm as its prologue (every task normalizes the hidden state it stages, as `norm_matvec`
does), and the block becomes:

- `norm_matvec` (router): the router logits, rows tiled over SMs like any projection;
- `moe_topk`: the routing decision (scores, group-limited top-k, weights) on one SM;
- `norm_matvec` epilogue `silu_mul` (shared expert gate/up), independent of the router, so
  that it streams while the top-k runs. It comes after the top-k in program order, which is
  each SM's stream order: before it, the top-k queued behind a shared gate/up task on its SM
  and the routed experts, which wait for it, started ~7 us later (DeepSeek-V3.2 MoE layer on
  the H200, docs/performance.md);
- `moe_gate_up`: silu(gate)·up of the chosen experts, one slot per chosen expert, each slot's
  rows tiled over SMs; a task's weights are picked at run time by the slot's expert id;
- `moe_down_add`: per output row tile, the weighted sum of the slots' down projections plus
  the shared expert's down projection plus the residual: the whole block ends in one op.
"""

from __future__ import annotations

from tilertc.ir.graph import Op, TensorKind
from tilertc.ir.moe import EXPERT_PROJECTIONS
from tilertc.passes.fusion import Fusion, operands
from tilertc.passes.program import ScheduleError


def fuse_moe(f: Fusion, norm: Op) -> None:
    g, layer = f.g, norm.layer
    users = f.consumers(norm.outputs[0])
    router = next(op for op in users if op.opcode == "moe_router")
    experts = next(op for op in users if op.opcode == "moe_experts")
    shared = [op for op in users if op.opcode == "linear"]
    x, gamma = norm.inputs
    h, eps = g.tensors[x].numel, norm.attrs["eps"]
    common = {"K": h, "eps": eps, "in_offset": 0}
    e = router.attrs["num_experts"]
    logits = f.out.tensor(f"layers.{layer}.moe.router_logits", (e,), "fp32",
                          TensorKind.ACTIVATION)
    f.emit(router.name, "norm_matvec", [x, gamma, router.inputs[1]], [logits], layer,
           [norm, router], rows=e, epilogue="none", interleave=False, **common)
    ids, weights = router.outputs
    f.emit(f"layers.{layer}.moe.topk", "moe_topk", [logits, *router.inputs[2:]],
           [ids, weights], layer, [router], **router.attrs)
    shared_act, shared_down, shared_tail, last = [], [], [], experts
    if shared:
        act = f.consumers(shared[0].outputs[0])[0]
        down = f.consumers(act.outputs[0])[0]
        combine = f.consumers(down.outputs[0])[0]
        f.emit(shared[0].name.rsplit(".", 1)[0] + ".gate_up_proj", "norm_matvec",
               [x, gamma, *(op.inputs[1] for op in shared)], list(act.outputs), layer,
               [norm, *shared, act], rows=g.tensors[act.outputs[0]].numel, epilogue="silu_mul",
               interleave=True, **common)
        shared_act, shared_down = list(act.outputs), [down.inputs[1]]
        shared_tail, last = [down, combine], combine
    residual = f.consumers(last.outputs[0])
    if len(residual) != 1 or residual[0].opcode != "add":
        raise ScheduleError(f"op {last.name!r}: a MoE block must end in a residual add")
    residual = residual[0]
    res_in = next(t for t in residual.inputs if t != last.outputs[0])
    a = experts.attrs
    inter, slots = a["intermediate_size"], a.get("slots", a["top_k"])
    per_expert = len(EXPERT_PROJECTIONS)
    expert_w = operands(g, experts)[3:]
    is_down = [EXPERT_PROJECTIONS[i % per_expert] == "down_proj" for i in range(len(expert_w))]
    gate_up = [w for w, d in zip(expert_w, is_down, strict=True) if not d]
    down = [w for w, d in zip(expert_w, is_down, strict=True) if d]
    act = f.out.tensor(f"layers.{layer}.moe.act", (slots * inter,), "fp32",
                       TensorKind.ACTIVATION)
    routing = {"intermediate_size": inter, "slots": slots, "top_k": a["top_k"],
               "num_experts": a["num_experts"],
               "local_experts": a.get("local_experts", [0, a["num_experts"]])}
    f.emit(f"layers.{layer}.moe.gate_up", "moe_gate_up", [x, gamma, ids, *gate_up], [act],
           layer, [norm, experts], rows=slots * inter, interleave=True, **common, **routing)
    shared_inter = g.tensors[shared_act[0]].numel if shared_act else 0
    f.emit(f"layers.{layer}.moe.down_proj", "moe_down_add",
           [act, ids, weights, *shared_act, res_in, *down, *shared_down], list(residual.outputs),
           layer, [experts, *shared_tail, residual], K=slots * inter + shared_inter, rows=h,
           shared_intermediate=shared_inter, **routing)


def down_inputs(op: Op) -> tuple[str, str, str, str | None, str, list[str], str | None]:
    """The inputs of a `moe_down_add` as `fuse_moe` orders them: (act, ids, weights, shared
    act, residual, the experts' down weights, the shared expert's down weight)."""
    shared = op.attrs["shared_intermediate"] > 0
    act, ids, weights = op.inputs[:3]
    rest = list(op.inputs[3:])
    shared_act = rest.pop(0) if shared else None
    residual = rest.pop(0)
    shared_down = rest.pop() if shared else None
    return act, ids, weights, shared_act, residual, rest, shared_down
