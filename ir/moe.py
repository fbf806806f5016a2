"""Mixture-of-experts feed-forward: router, routed experts picked at run time, shared expert.

A MoE layer is three ops: `moe_router` turns the normed hidden state into k expert ids and k
combine weights (routed scaling included), `moe_experts` runs the chosen experts' SwiGLUs and sums
them with those weights, and an optional shared-expert SwiGLU is added on top. Every expert's
weights are separate tensors named by their checkpoint key (`mlp.experts.{e}.gate_proj.weight`,
...), so the experts op lists all of them as inputs and reads only the k it is routed to: a
decode step streams k experts, not all of them.

Routers (as in transformers):
- Qwen3-MoE: softmax over all experts, top-k, optionally renormalized.
- DeepSeek-V3 family ("noaux_tc"): sigmoid scores; selection on scores + correction bias, within
  the `topk_group` groups whose two best biased scores sum highest; weights are the unbiased
  scores of the chosen experts, renormalized, times `routed_scaling_factor`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tilertc.ir.blocks import (
    act,
    post_attention_norm,
    projection_weight,
    residual,
    swiglu,
    weight,
)
from tilertc.ir.graph import Graph, Op
from tilertc.ir.interpreter import Step, semantics
from tilertc.model_specs.spec import ModelSpec

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # per-expert input order


def moe_ffn_block(g: Graph, spec: ModelSpec, layer: int, x: str) -> str:
    """x + MoE(post_attention_layernorm(x)), weights named as in the family's checkpoints."""
    moe, h, i = spec.moe, spec.hidden_size, layer
    e, k, inter = moe.num_experts, moe.experts_per_token, moe.moe_intermediate_size
    xn = post_attention_norm(g, spec, i, x)
    router_ins = [xn, weight(g, i, "mlp.gate", (e, h))]
    if moe.has_correction_bias:
        router_ins.append(weight(g, i, "mlp.gate.e_score_correction_bias", (e,), "fp32",
                                 param=None))
    ids = act(g, i, "moe.expert_ids", (k,), "int64")
    weights = act(g, i, "moe.expert_weights", (k,))
    g.add(f"layers.{i}.moe.router", "moe_router", router_ins, [ids, weights], layer=i,
          num_experts=e, top_k=k, scoring=moe.scoring, n_group=moe.n_group,
          topk_group=moe.topk_group, norm_topk_prob=moe.norm_topk_prob,
          routed_scaling_factor=moe.routed_scaling_factor)
    shapes = {"gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}
    experts = [t for j in range(e) for p in EXPERT_PROJECTIONS
               for t in projection_weight(g, i, f"mlp.experts.{j}.{p}", shapes[p])]
    routed = act(g, i, "moe.routed", (h,))
    g.add(f"layers.{i}.moe.experts", "moe_experts", [xn, ids, weights, *experts], [routed],
          layer=i, num_experts=e, top_k=k, intermediate_size=inter)
    y = routed
    if moe.num_shared_experts:
        shared = swiglu(g, i, "mlp.shared_experts", xn, h, inter * moe.num_shared_experts)
        y = act(g, i, "moe.out", (h,))
        g.add(f"layers.{i}.moe.combine", "add", [routed, shared], [y], layer=i)
    return residual(g, i, x, y)


def top(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest along the last dim, largest first; equal values: the lower index
    first. torch.topk leaves the order of ties to the implementation (on CPU it can take a
    higher index first); a routing decision must be one the kernel can reproduce."""
    return x.sort(dim=-1, descending=True, stable=True).indices[..., :k]


def route(logits: torch.Tensor, bias: torch.Tensor | None, a: dict) -> tuple[torch.Tensor,
                                                                           torch.Tensor]:
    """Expert ids [T, k] (by descending selection score, ties to the lower expert) and combine
    weights [T, k] (fp32)."""
    scores = logits.softmax(-1) if a["scoring"] == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias
    n_group, topk_group = a["n_group"], a["topk_group"]
    if topk_group < n_group:
        grouped = choice.reshape(choice.shape[0], n_group, -1)
        group_score = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, top(group_score, topk_group), True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).reshape_as(choice)
    ids = top(choice, a["top_k"])
    w = scores.gather(1, ids)
    if a["norm_topk_prob"]:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)  # the epsilon only guards an all-zero sum
    return ids, w * a["routed_scaling_factor"]


@semantics("moe_router")
def _moe_router(op: Op, ins: list[torch.Tensor], step: Step) -> list[torch.Tensor]:
    # Routing is a discrete decision: score in fp32 whatever the interpreter's dtype.
    logits = F.linear(ins[0].float(), ins[1].float())
    bias = ins[2].float() if len(ins) > 2 else None
    return list(route(logits, bias, op.attrs))


@semantics("moe_experts", own_widening=True)
def _moe_experts(op: Op, ins: list[torch.Tensor], step: Step) -> list[torch.Tensor]:
    # The experts' weights come as stored and only the chosen ones are widened, one expert at a
    # time: all of a full-size layer's at once would be ~45 GB of fp32 on the GPU.
    x, ids = ins[0], ins[1]
    w = ins[2].to(x.dtype)
    per_expert = len(EXPERT_PROJECTIONS)
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        gate, up, down = (p.to(x.dtype) for p in ins[3 + per_expert * e: 3 + per_expert * (e + 1)])
        rows, slots = (ids == e).nonzero(as_tuple=True)
        xe = x[rows]
        y = F.linear(F.silu(F.linear(xe, gate)) * F.linear(xe, up), down)
        out.index_add_(0, rows, y * w[rows, slots, None])
    return [out]
