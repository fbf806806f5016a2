"""The correctness gate `tilertc bench` passes before it times anything.

A fast kernel that computes something else is not a result, and neither is a baseline that
decodes another model. So, over a short run, the kernel's logits must match the interpreter's
(fed the same tokens, same weights), the kernel's tokens must be the greedy choice of its own
logits and of the interpreter's wherever the top-2 margin is clear of rounding noise. The
kernel-per-op baseline computes in bf16 throughout, as Hugging Face's models do, and its logits
are further from the float32 interpreter's than the kernel's (6.5 % on llama-3.1-8b's 32 layers
with random weights, docs/performance.md): they must match the interpreter's within a bf16
engine's error at every step it decoded from the kernel's history, that is up to and including
the first step where it picks another token (a near tie at its precision; after it the two runs
follow different histories). Without its logits, its tokens must be the kernel's until the
first step whose margin is not clear. A step
the kernel routed or selected otherwise within a tie (MoE, DSA: `choice_check`) computes
other experts or attends to other tokens by design; it is counted, not compared.

The gate is a pure function of tensors and token lists, so that a planted mismatch is tested
on a CPU; `tilertc.bench` collects its inputs on the GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

REL_TOL = 2e-2  # max ||kernel - interpreter|| / ||interpreter|| per step, up to REL_TOL_LAYERS
REL_TOL_LAYERS = 32
BASELINE_REL_TOL = 0.15  # the same for a bf16 baseline; another model is off by ~100 %
MARGIN = 2e-2  # a top-2 gap above this share of max |logit| is clear of bf16 noise
MIN_CLEAR_STEPS = 4  # greedy tokens must be checked at this many clear steps at least


def depth_tolerance(num_layers: int) -> float:
    """The gate's relative tolerance for a model of `num_layers` layers. The kernel rounds to
    bf16 where the tensor cores take their operands (attention's queries and probabilities) and
    in its caches; those roundings are independent from layer to layer, so the logits' error
    against the float32 interpreter grows with depth like a random walk's. Measured with random
    weights: 1.6-1.8 % at 32 layers (llama-3.1-8b), 2.03 % at 64 (qwen3-32b FP8), where a fixed
    REL_TOL failed a kernel whose other checks pass; a wrong kernel is off by tens of %."""
    return REL_TOL * max(1.0, (num_layers / REL_TOL_LAYERS) ** 0.5)


class GateFailure(RuntimeError):
    """The kernel (or the baseline it is compared with) does not compute the model."""

    def __init__(self, report: GateReport, system: str = "tilertc") -> None:
        self.report = report
        super().__init__(f"correctness gate failed for {system}, no numbers reported:\n  "
                         + "\n  ".join(report.problems))


@dataclass
class GateReport:
    steps: int
    max_rel_err: float
    median_rel_err: float
    clear_steps: int  # compared steps whose interpreter top-2 margin is clear
    baseline: str | None  # the baseline whose tokens were compared, if any
    baseline_tokens_compared: int = 0
    baseline_diverged_at: int | None = None  # first step it chose another token (allowed)
    baseline_max_rel_err: float | None = None  # of its logits up to there, where it gave them
    tied_steps: list[int] = field(default_factory=list)  # routed or selected otherwise within a tie
    problems: list[str] = field(default_factory=list)
    rel_tol: float = REL_TOL

    @property
    def passed(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed, "margin": MARGIN}


def clear_margins(reference: torch.Tensor, margin: float = MARGIN) -> list[bool]:
    """Per step of `reference` [steps, vocab]: is the top-2 gap above `margin` × max |logit|?"""
    top2 = reference.topk(2, dim=-1).values
    return ((top2[:, 0] - top2[:, 1]) > margin * reference.abs().amax(-1)).tolist()


def check_decode(kernel_logits: torch.Tensor, reference_logits: torch.Tensor,
                 kernel_tokens: Sequence[int], baseline_tokens: Sequence[int] | None = None,
                 baseline: str | None = None, rel_tol: float = REL_TOL,
                 margin: float = MARGIN, tied: Sequence[bool] | None = None,
                 baseline_logits: torch.Tensor | None = None) -> GateReport:
    """Judge a short greedy run. Step i of `kernel_logits` and `reference_logits`
    ([steps, vocab]) came from the same input token; `kernel_tokens[i]` is the kernel's choice at
    step i and `baseline_tokens[i]` the baseline's own greedy choice at that step (from
    `baseline_logits[i]`, where given); `tied[i]` says the kernel routed or selected otherwise
    within a tie at step i (its logits and token are not compared)."""
    k, r = kernel_logits.double(), reference_logits.double()
    if k.shape != r.shape or k.dim() != 2 or len(kernel_tokens) != k.shape[0]:
        raise ValueError(f"logits {tuple(k.shape)} and {tuple(r.shape)} with "
                         f"{len(kernel_tokens)} tokens: need [steps, vocab] each and one token "
                         "per step")
    tied = list(tied) if tied is not None else [False] * k.shape[0]
    errs = ((k - r).norm(dim=-1) / r.norm(dim=-1)).tolist()
    compared = [e for e, t in zip(errs, tied, strict=True) if not t] or [0.0]
    clear = [c and not t for c, t in zip(clear_margins(r, margin), tied, strict=True)]
    report = GateReport(len(errs), max(compared), float(torch.tensor(compared).median()),
                        sum(clear), baseline, tied_steps=[i for i, t in enumerate(tied) if t],
                        rel_tol=rel_tol)
    problems = report.problems
    for i, err in enumerate(errs):
        if err > rel_tol and not tied[i]:
            problems.append(f"step {i}: the kernel's logits differ from the interpreter's by a "
                            f"relative error of {err:.3g} (tolerance {rel_tol:g})")
    own = k.argmax(-1).tolist()
    want = r.argmax(-1).tolist()
    for i, tok in enumerate(kernel_tokens):
        if tok != own[i]:
            problems.append(f"step {i}: the kernel emitted token {tok}, but the argmax of its "
                            f"own logits is {own[i]}")
        elif clear[i] and tok != want[i]:
            problems.append(f"step {i}: the kernel chose token {tok}, the interpreter {want[i]} "
                            "with a clear top-2 margin")
    if sum(clear) < min(MIN_CLEAR_STEPS, len(errs)):
        problems.append(f"only {sum(clear)} of {len(errs)} steps have a clear top-2 margin: too "
                        "few to check greedy tokens (use weights with sharper logits)")
    if baseline_tokens is not None:
        _compare_baseline(report, kernel_tokens, baseline_tokens, clear, r, baseline_logits)
    return report


def _compare_baseline(report: GateReport, kernel_tokens: Sequence[int],
                      baseline_tokens: Sequence[int], clear: list[bool], reference: torch.Tensor,
                      baseline_logits: torch.Tensor | None) -> None:
    """Walk both greedy runs until they part. With the baseline's logits, each step's up to the
    parting must be the interpreter's within BASELINE_REL_TOL; without them, parting where the
    margin is clear is a failure."""
    name = report.baseline or "the baseline"
    n = min(len(kernel_tokens), len(baseline_tokens))
    parted = next((i for i in range(n) if kernel_tokens[i] != baseline_tokens[i]), None)
    report.baseline_tokens_compared = n if parted is None else parted
    if baseline_logits is not None:
        upto = n if parted is None else parted + 1
        b, r = baseline_logits[:upto].double(), reference[:upto]
        errs = ((b - r).norm(dim=-1) / r.norm(dim=-1)).tolist()
        report.baseline_max_rel_err = max(errs)
        report.problems += [f"step {i}: {name}'s logits differ from the interpreter's by a "
                            f"relative error of {e:.3g} (tolerance {BASELINE_REL_TOL:g})"
                            for i, e in enumerate(errs) if e > BASELINE_REL_TOL]
    if parted is None:
        return
    if baseline_logits is None and clear[parted]:
        report.problems.append(f"step {parted}: {name} chose token {baseline_tokens[parted]}, "
                               f"the kernel {kernel_tokens[parted]}, with a clear top-2 margin")
    else:
        report.baseline_diverged_at = parted
