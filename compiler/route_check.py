"""Whether the kernel routed a decode step as the interpreter did, up to ties.

The kernel's router and the interpreter's sum the same products in different orders, so two
experts whose selection values are within fp32 rounding may be ordered either way. Such a step
then runs other experts by design and its logits are not comparable; any other difference in
the chosen experts, or in their combine weights, is a bug. The tests and the bench's
correctness gate judge routing here, on the interpreter's tensors of the same step (`env`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tilertc.passes.task_semantics_moe import local_routes

ROUTING_TIE = 1e-4  # selection values this close may be ordered either way by fp32 rounding
WEIGHT_RTOL, WEIGHT_ATOL = 1e-3, 1e-6  # combine weights of the same experts: fp32 rounding


@dataclass(frozen=True)
class RouteCheck:
    """One MoE layer's routing at one step, kernel against interpreter."""

    layer: int
    same: bool  # the same experts, best first, with the same combine weights
    gap: float = 0.0  # where not: how far from a tie the first difference is (inf: not a tie)
    detail: str = ""

    @property
    def tied(self) -> bool:
        """Routed differently, but only between experts within rounding of a tie."""
        return not self.same and self.gap <= ROUTING_TIE

    @property
    def ok(self) -> bool:
        return self.same or self.tied

    def __str__(self) -> str:
        return f"layer {self.layer}: {self.detail}"


def selection_values(weight: Any, op: Any, env: dict[str, torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the interpreter's router selected by: each expert's score (softmax or sigmoid)
    plus the correction bias, and with group-limited routing each expert's group's score (the
    sum of its two best values), as ir/moe.py: route computes them. `weight(tensor name)` gives
    a router weight in float32."""
    a, x = op.attrs, env[op.inputs[0]][0].float()
    logits = x @ weight(op.inputs[1]).to(x.device).T
    choice = logits.softmax(-1) if a["scoring"] == "softmax" else logits.sigmoid()
    if len(op.inputs) > 2:
        choice = choice + weight(op.inputs[2]).to(x.device)
    if a["topk_group"] >= a["n_group"]:
        return choice, None
    grouped = choice.reshape(a["n_group"], -1)
    return choice, grouped.topk(2, -1).values.sum(-1).repeat_interleave(grouped.shape[1])


def check_routes(engine: Any, env: dict[str, torch.Tensor]) -> list[RouteCheck]:
    """Per MoE layer of the engine's last step: its routing against the interpreter's (`env`,
    the same step). Under expert parallelism each rank's slots are compared with the
    interpreter's routing as that rank keeps it (`local_routes`)."""
    def weight(name: str) -> torch.Tensor:  # the engine keeps its checkpoint on the host
        return engine.weights[engine.graph.tensors[name].hf_name].float()

    routers = [op for op in engine.graph.ops() if op.opcode == "moe_router"]
    ranks = getattr(engine, "engines", None)
    out = []
    for op in routers:
        ids, weights = env[op.outputs[0]].cpu(), env[op.outputs[1]].cpu()
        if ranks is None:
            got, got_w = engine.routing()[op.layer]
            chosen, wanted = got, ids[0].tolist()
            same_w = got == wanted and torch.allclose(
                torch.tensor(got_w), weights[0].float(), rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL)
        else:
            chosen, wanted, same_w = _ranks_routes(engine, op, ids, weights)
        if same_w:
            out.append(RouteCheck(op.layer, True))
        elif chosen == wanted:
            out.append(RouteCheck(op.layer, False, float("inf"), "the same experts "
                                  f"{wanted} with other combine weights"))
        else:
            out.append(_difference(op.layer, chosen, wanted, selection_values(weight, op, env)))
    return out


def _ranks_routes(engine: Any, op: Any, ids: torch.Tensor, weights: torch.Tensor
                  ) -> tuple[list[int], list[int], bool]:
    """Under expert parallelism: (the experts the ranks chose, rank by rank, best first within
    each; the interpreter's, arranged the same way; whether every rank's combine weights are
    the interpreter's too)."""
    local = engine.m["tp"]["experts_per_rank"]
    a = op.attrs
    attrs = {"num_experts": a["num_experts"], "top_k": a["top_k"], "slots": min(a["top_k"], local)}
    chosen, wanted, same_w = [], [], True
    for r, e in enumerate(engine.engines):
        got, got_w = (v[:attrs["slots"]] for v in e.routing()[op.layer])
        want, want_w = local_routes(ids, weights, {**attrs, "local_experts": [r * local,
                                                                            (r + 1) * local]})
        chosen += [g + r * local for g in got if g >= 0]
        wanted += [g + r * local for g in want.tolist() if g >= 0]
        same_w = same_w and got == want.tolist() and torch.allclose(
            torch.tensor(got_w), want_w.float(), rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL)
    return chosen, wanted, same_w


def _difference(layer: int, chosen: list[int], wanted: list[int],
                values: tuple[torch.Tensor, torch.Tensor | None]) -> RouteCheck:
    """How far from a tie the kernel's choice is. Other experts: each one the kernel chose and
    the interpreter did not against its closest one the interpreter chose instead; the same
    experts in another order (the order sets the combine slots): the first two out of place.
    Closeness is by selection value, or by group score where groups limit the choice."""
    def closeness(e: int, f: int) -> float:
        return min(abs(float(v[e] - v[f])) for v in values if v is not None)

    extra = [e for e in chosen if e not in wanted]
    missing = [f for f in wanted if f not in chosen]
    if len(chosen) != len(wanted):
        gap = float("inf")
    elif extra:
        gap = max(min(closeness(e, f) for f in missing) for e in extra)
    else:
        gap = next(closeness(e, f) for e, f in zip(chosen, wanted, strict=True) if e != f)
    return RouteCheck(layer, False, gap, f"kernel experts {chosen}, interpreter {wanted} "
                      f"(selection values differ by {gap:.3g})")
