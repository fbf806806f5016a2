"""Is a kernel deterministic, and is a launch of many steps the same as one launch a step? On a
GPU machine:

    python tools/loop_check.py ARTIFACT [ARTIFACT ...] [--prompt 100] [--tokens 32]

For each artifact, on its random weights (seed 1234, as the GPU tests load them) and one random
prompt: greedy tokens from two launches of `--tokens` steps each, and from as many one-step
launches, with the logits of every single step kept and each step repeated once. Prints how far
a repeated single step's logits move (rows split over warps add in shared memory in whatever
order the warps come: not bit-identical; FP8 tile sums add in a fixed order), the smallest gap
between a step's two best logits, and where the three token lists first part with the gap there
(a near tie that a difference in the last bits may flip); gaps and differences relative to the
step's largest |logit|. The GPU test `test_token_loop_equals_single_steps` asks about tokens
only; this says which of the three differs and by how much.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from tilertc.engine import Engine


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def check(artifact: Path, prompt_len: int, tokens: int) -> None:
    engine = Engine.load(artifact, random_seed=1234)
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, engine.spec.vocab_size, (prompt_len,), generator=gen)
    loops = []
    for _ in range(2):
        engine.position = 0
        loops.append(list(engine.generate(prompt, max_new_tokens=tokens)))
    engine.position = 0
    engine.prefill(prompt[:-1])
    tok, stepped, gaps, repeat_diff = int(prompt[-1]), [], [], 0.0
    for _ in range(tokens):
        pos = engine.position
        nxt, out = engine.step(tok)
        engine.position = pos  # the same step again: the same KV entry is rewritten
        _, out_again = engine.step(tok)
        out = out.float()
        scale = float(out.abs().max())
        repeat_diff = max(repeat_diff, float((out - out_again.float()).abs().max()) / scale)
        gaps.append(float(out.topk(2).values.diff().abs()) / scale)
        tok = nxt
        stepped.append(tok)
    print(f"{artifact}: a single step repeated differs by at most {repeat_diff:.3g} of the "
          f"largest |logit|; the smallest top-2 gap of a step is {min(gaps):.3g} of it (step "
          f"{gaps.index(min(gaps))})")
    for what, other in (("loop vs loop", loops[1]), ("loop vs single steps", stepped)):
        at = first_difference(loops[0], other)
        print(f"  {what}: first differs at {at}"
              + ("" if at is None else f" (single step's top-2 gap there {gaps[at]:.3g})"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", nargs="+", type=Path)
    ap.add_argument("--prompt", type=int, default=100)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    for a in args.artifacts:
        check(a, args.prompt, args.tokens)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
