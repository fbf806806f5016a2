"""The correctness gate `tilertc bench` passes before it times anything.

A fast kernel that computes something else is not a result, and neither is a baseline that
decodes another model. So, over a short run, the kernel's logits must match the interpreter's
(fed the same tokens, same weights), the kernel's tokens must be the greedy choice of its own
logits and of the interpreter's wherever the top-2 margin is clear of rounding noise, and the
kernel-per-op baseline must pick the same greedy tokens as the kernel until the first step
whose margin is not clear (after a tie-break the two runs follow different histories).

The gate is a pure function of tensors and token lists, so that a planted mismatch is tested
on a CPU; `tilertc.bench` collects its inputs on the GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

REL_TOL = 2e-2  # max ||kernel - interpreter|| / ||interpreter|| per step
MARGIN = 2e-2  # a top-2 gap above this share of max |logit| is clear of bf16 noise
MIN_CLEAR_STEPS = 4  # greedy tokens must be checked at this many clear steps at least


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
    clear_steps: int  # steps whose interpreter top-2 margin is clear
    baseline: str | None  # the baseline whose tokens were compared, if any
    baseline_tokens_compared: int = 0
    baseline_diverged_at: int | None = None  # first differing step (an unclear margin)
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed, "rel_tol": REL_TOL, "margin": MARGIN}


def clear_margins(reference: torch.Tensor, margin: float = MARGIN) -> list[bool]:
    """Per step of `reference` [steps, vocab]: is the top-2 gap above `margin` × max |logit|?"""
    top2 = reference.topk(2, dim=-1).values
    return ((top2[:, 0] - top2[:, 1]) > margin * reference.abs().amax(-1)).tolist()


def check_decode(kernel_logits: torch.Tensor, reference_logits: torch.Tensor,
                 kernel_tokens: Sequence[int], baseline_tokens: Sequence[int] | None = None,
                 baseline: str | None = None, rel_tol: float = REL_TOL,
                 margin: float = MARGIN) -> GateReport:
    """Judge a short greedy run. Step i of `kernel_logits` and `reference_logits`
    ([steps, vocab]) came from the same input token; `kernel_tokens[i]` is the kernel's choice at
    step i and `baseline_tokens[i]` the baseline's own greedy choice at that step."""
    k, r = kernel_logits.double(), reference_logits.double()
    if k.shape != r.shape or k.dim() != 2 or len(kernel_tokens) != k.shape[0]:
        raise ValueError(f"logits {tuple(k.shape)} and {tuple(r.shape)} with "
                         f"{len(kernel_tokens)} tokens: need [steps, vocab] each and one token "
                         "per step")
    errs = ((k - r).norm(dim=-1) / r.norm(dim=-1)).tolist()
    clear = clear_margins(r, margin)
    report = GateReport(len(errs), max(errs), float(torch.tensor(errs).median()), sum(clear),
                        baseline)
    problems = report.problems
    for i, err in enumerate(errs):
        if err > rel_tol:
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
        _compare_baseline(report, kernel_tokens, baseline_tokens, clear)
    return report


def _compare_baseline(report: GateReport, kernel_tokens: Sequence[int],
                      baseline_tokens: Sequence[int], clear: list[bool]) -> None:
    """Walk both greedy runs until they part; parting where the margin is clear is a failure."""
    name = report.baseline or "the baseline"
    n = min(len(kernel_tokens), len(baseline_tokens))
    for i in range(n):
        if kernel_tokens[i] == baseline_tokens[i]:
            report.baseline_tokens_compared = i + 1
            continue
        if clear[i]:
            report.problems.append(f"step {i}: {name} chose token {baseline_tokens[i]}, the "
                                   f"kernel {kernel_tokens[i]}, with a clear top-2 margin")
        else:
            report.baseline_diverged_at = i
        return
