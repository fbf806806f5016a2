"""compiler/choice_check.py on made-up indexer outputs (no GPU): a selection differing only
near the cut, within the kernel's own score error, is a tie, and the layers after it are not
judged; a token far from the cut, or scores off by more than rounding, is a bug."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from tilertc.choice_check import check_choices

HEADS, DIM, N, TOPK = 2, 4, 12, 8


def op(name: str, opcode: str, layer: int, inputs: list[str], outputs: list[str]):
    attrs = {"n_heads": HEADS, "head_dim": DIM, "head_weight_scale": 1.0, "softmax_scale": 1.0}
    return SimpleNamespace(name=name, opcode=opcode, layer=layer, inputs=inputs,
                           outputs=outputs, attrs=attrs)


class FakeEngine:
    """Two layers with an indexer each; the kernel's scores are the interpreter's plus `error`
    and its top-k is taken from them (as a working kernel would)."""

    def __init__(self, env: dict[str, torch.Tensor], error: dict[int, torch.Tensor],
                 picked: list[int] | None = None) -> None:
        self.position, self.picked = N, picked  # picked: layer 0's selection, made up
        ops = []
        for layer in (0, 1):
            p = f"layers.{layer}.dsa"
            ops += [op(f"{p}.score", "dsa_score", layer, [f"{p}.q", f"{p}.w", f"{p}.k_cache"],
                       [f"{p}.scores"]),
                    op(f"{p}.topk", "dsa_topk", layer, [f"{p}.scores"], [f"{p}.topk"])]
        self.graph = SimpleNamespace(ops=lambda: ops, op=lambda n: next(o for o in ops
                                                                       if o.name == n))
        self.scores = {layer: env[f"layers.{layer}.dsa.scores"][0] + error[layer]
                       for layer in (0, 1)}

    def index_scores(self) -> dict[int, torch.Tensor]:
        return self.scores

    def selection(self) -> dict[int, list[int]]:
        return {layer: self.picked if layer == 0 and self.picked else top(s)
                for layer, s in self.scores.items()}


def top(scores: torch.Tensor) -> list[int]:
    return sorted(scores.topk(TOPK).indices.tolist())


def interpreter_env(seed: int) -> dict[str, torch.Tensor]:
    """Scores computed from random q, head weights and keys, and their top-k, per layer; the
    best unselected token's key is the lowest selected one's, scaled by 1 - 1e-6 (a near
    tie at the cut)."""
    gen = torch.Generator().manual_seed(seed)
    env = {}
    for layer in (0, 1):
        p = f"layers.{layer}.dsa"
        q, w = torch.randn(1, HEADS * DIM, generator=gen), torch.randn(1, HEADS, generator=gen)
        k = torch.randn(N, DIM, generator=gen)
        scores = torch.einsum("h,hd,nd->n", w[0], q[0].view(HEADS, DIM), k)
        order = scores.argsort(descending=True)
        k[order[TOPK]] = k[order[TOPK - 1]] * (1 - 1e-6)
        scores = torch.einsum("h,hd,nd->n", w[0], q[0].view(HEADS, DIM), k)
        env |= {f"{p}.q": q, f"{p}.w": w, f"{p}.k_cache": k, f"{p}.scores": scores[None],
                f"{p}.topk": torch.tensor([top(scores)])}
    return env


def swap_at_cut(env: dict[str, torch.Tensor], layer: int, by: float) -> torch.Tensor:
    """An error on layer `layer`'s scores that lifts the best unselected token `by` above the
    cut (the lowest selected score): the two swap places."""
    scores = env[f"layers.{layer}.dsa.scores"][0]
    order = scores.argsort(descending=True)
    cut, first_out = order[TOPK - 1], order[TOPK]
    error = torch.zeros(N)
    error[first_out] = float(scores[cut] - scores[first_out]) + by
    return error


def test_same_selection_is_same() -> None:
    env = interpreter_env(1)
    checks = check_choices(FakeEngine(env, {0: torch.zeros(N), 1: torch.zeros(N)}), env)
    assert [(c.layer, c.op, c.same) for c in checks] == [(0, "selection", True),
                                                         (1, "selection", True)]


def test_swap_within_the_kernels_score_error_is_a_tie_and_later_layers_are_not_judged() -> None:
    env = interpreter_env(2)
    engine = FakeEngine(env, {0: swap_at_cut(env, 0, 1e-6), 1: torch.full((N,), 5.0)})
    first, second = check_choices(engine, env)
    assert not first.same and first.tied and first.ok, first.detail
    # layer 1's scores are far off, but it saw another input: not judged
    assert second.downstream and second.ok and not second.same


def test_scores_off_or_a_token_far_from_the_cut_is_a_bug() -> None:
    env = interpreter_env(2)
    scores = env["layers.0.dsa.scores"][0]
    last = int(scores.argmin())
    lifted = torch.zeros(N)
    lifted[last] = float(scores.max() - scores[last]) + 1.0  # to the top: far past rounding
    (check, _) = check_choices(FakeEngine(env, {0: lifted, 1: torch.zeros(N)}), env)
    assert not check.ok and "scale off" in check.detail, check.detail
    # the interpreter's scores exactly, but the lowest-scoring token selected instead of one
    picked = sorted([*top(scores)[1:], last])
    (check, _) = check_choices(FakeEngine(env, {0: torch.zeros(N), 1: torch.zeros(N)}, picked),
                               env)
    assert not check.ok and "from the cut" in check.detail, check.detail
