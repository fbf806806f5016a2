"""Whether the kernel made a decode step's discrete choices as the interpreter did, up to ties.

Two ops choose: an MoE router (its experts) and a DSA indexer's top-k (its context tokens).
The kernel computes the values they choose by in other summation orders than the interpreter,
and FP8 tile projections round their inputs further (`decode/tile_digits.cuh: stage_digits`), so two
candidates within that rounding of each other may be chosen either way. Such a step then
computes something else by design and its logits are not comparable; any other difference is
a bug. Once a layer chose otherwise, every later layer sees another input: its choices are not
judged (`downstream`). The tests and the bench's correctness gate judge choices here, on the
interpreter's tensors of the same step (`env`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from tilertc.passes.task_semantics_moe import local_routes

ROUTING_TIE = 1e-4  # selection values this close may be ordered either way by fp32 rounding
WEIGHT_RTOL, WEIGHT_ATOL = 1e-3, 1e-6  # combine weights of the same experts: fp32 rounding
# How far a kernel's index score may be from the interpreter's, relative to its terms' sum
# without signs (`score_scales`): a key row the kernel appended is the interpreter's only to a
# bf16 step, so its score only to about 2^-8 of that sum.
SCORE_ROUNDING = 2.0 ** -8


@dataclass(frozen=True)
class ChoiceCheck:
    """One layer's routing or selection at one step, kernel against interpreter."""

    layer: int
    op: str  # "routing" or "selection"
    same: bool  # the same choice (routing: and the same combine weights)
    tied: bool = False  # where not the same: only between candidates within rounding of a tie
    downstream: bool = False  # an earlier layer chose otherwise: not judged
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.same or self.tied or self.downstream

    def __str__(self) -> str:
        return f"layer {self.layer} {self.op}: {self.detail}"


CHOOSING_OPS = {"moe_router": "routing", "dsa_topk": "selection"}  # opcode: what it chooses


class _KernelChoices:
    """The engine's routing, selection and index scores of its last step, each read from the
    device once (each of its methods reads every layer's) and only where a check asks."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    @cached_property
    def routing(self) -> dict[int, tuple[list[int], list[float]]]:
        return self.engine.routing()

    @cached_property
    def selection(self) -> dict[int, list[int]]:
        return self.engine.selection()

    @cached_property
    def index_scores(self) -> dict[int, torch.Tensor]:
        return self.engine.index_scores()


def check_choices(engine: Any, env: dict[str, torch.Tensor]) -> list[ChoiceCheck]:
    """Every router's and indexer's choice at the engine's last step, in the graph's order,
    against the interpreter's (`env`, the same step); the ones after the first that differs
    are `downstream`."""
    kernel = _KernelChoices(engine)
    out: list[ChoiceCheck] = []
    for op in engine.graph.ops():
        if op.opcode not in CHOOSING_OPS:
            continue
        if out and not out[-1].same:
            out.append(ChoiceCheck(op.layer, CHOOSING_OPS[op.opcode], False, downstream=True))
        elif op.opcode == "moe_router":
            out.append(_routing(engine, kernel, op, env))
        else:
            out.append(_selection(engine, kernel, op, env))
    return out


def _routing(engine: Any, kernel: _KernelChoices, op: Any, env: dict[str, torch.Tensor]
             ) -> ChoiceCheck:
    """The router's experts against the interpreter's. Under expert parallelism each rank's
    slots are compared with the interpreter's routing as that rank keeps it (`local_routes`)."""
    def weight(name: str) -> torch.Tensor:  # the engine keeps its checkpoint on the host
        return engine.weights[engine.graph.tensors[name].hf_name].float()

    ids, weights = env[op.outputs[0]].cpu(), env[op.outputs[1]].cpu()
    if getattr(engine, "engines", None) is None:
        chosen, got_w = kernel.routing[op.layer]
        wanted = ids[0].tolist()
        same_w = chosen == wanted and torch.allclose(
            torch.tensor(got_w), weights[0].float(), rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL)
    else:
        chosen, wanted, same_w = _ranks_routes(engine, op, ids, weights)
    if same_w:
        return ChoiceCheck(op.layer, "routing", True)
    if chosen == wanted:
        return ChoiceCheck(op.layer, "routing", False,
                           detail=f"the same experts {wanted} with other combine weights")
    gap = _routing_gap(chosen, wanted, selection_values(weight, op, env))
    return ChoiceCheck(op.layer, "routing", False, gap <= ROUTING_TIE,
                       detail=f"kernel experts {chosen}, interpreter {wanted} "
                       f"(selection values differ by {gap:.3g})")


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


def _routing_gap(chosen: list[int], wanted: list[int],
                 values: tuple[torch.Tensor, torch.Tensor | None]) -> float:
    """How far from a tie the kernel's choice is. Other experts: each one the kernel chose and
    the interpreter did not against its closest one the interpreter chose instead; the same
    experts in another order (the order sets the combine slots): the first two out of place.
    Closeness is by selection value, or by group score where groups limit the choice."""
    def closeness(e: int, f: int) -> float:
        return min(abs(float(v[e] - v[f])) for v in values if v is not None)

    extra = [e for e in chosen if e not in wanted]
    missing = [f for f in wanted if f not in chosen]
    if len(chosen) != len(wanted):
        return float("inf")
    if extra:
        return max(min(closeness(e, f) for f in missing) for e in extra)
    return next(closeness(e, f) for e, f in zip(chosen, wanted, strict=True) if e != f)


def _selection(engine: Any, kernel: _KernelChoices, op: Any, env: dict[str, torch.Tensor]
               ) -> ChoiceCheck:
    """The indexer's top-k against the interpreter's. Where the token sets differ, each token
    in one and not the other must score (the interpreter's score) within twice the kernel's
    largest score error of the interpreter's cut: if the kernel's scores are each within d of
    the interpreter's, only such tokens can change places. That error must itself be rounding
    (`SCORE_ROUNDING` of `score_scales`)."""
    got = kernel.selection[op.layer]
    want = env[op.outputs[0]][0].tolist()
    if got == want:
        return ChoiceCheck(op.layer, "selection", True)
    n = engine.position
    scores = env[op.inputs[0]][0][:n].double()
    error = (kernel.index_scores[op.layer][:n].to(scores.device).double() - scores).abs()
    off = float((error / score_scales(engine, env, op.layer, n).to(scores.device)).max())
    apart = sorted(set(got) ^ set(want))
    if -1 in apart or off > SCORE_ROUNDING:
        return ChoiceCheck(op.layer, "selection", False, detail=(
            "selections of different sizes" if -1 in apart else
            f"index scores {off:.3g} of their scale off the interpreter's"))
    cut = float(scores[[t for t in want if t >= 0]].min())
    gap = float((scores[apart] - cut).abs().max())
    return ChoiceCheck(op.layer, "selection", False, gap <= 2 * float(error.max()), detail=(
        f"{len(apart)} tokens apart, up to {gap:.3g} from the cut; the kernel's scores are "
        f"up to {float(error.max()):.3g} off"))


def score_scales(engine: Any, env: dict[str, torch.Tensor], layer: int, n: int) -> torch.Tensor:
    """Per token of the first `n`, Σ_h |w_h| · |q_h|·|k| (the index score's terms without
    their signs, scaled as the score is): what a score's rounding is relative to. The tensor
    cores take q as bf16 hi + lo (16 significand bits), so each head's term is within ~2^-16
    of itself, and the score within that of this sum, not of its own value: heads of opposite
    weight cancel."""
    op = engine.graph.op(f"layers.{layer}.dsa.score")
    q_name, w_name, cache_name = op.inputs[:3]
    q, w, cache, a = env[q_name][0], env[w_name][0], env[cache_name], op.attrs
    q = q.reshape(a["n_heads"], a["head_dim"]).abs().double()
    w = (w.abs() * a["head_weight_scale"] * a["softmax_scale"]).double()
    return torch.einsum("h,hd,nd->n", w, q, cache[:n].abs().double())
