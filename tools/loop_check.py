"""Is a kernel deterministic, and is a launch of many steps the same as one launch a step? On a
GPU machine:

    python tools/loop_check.py ARTIFACT [ARTIFACT ...] [--prompt 100] [--tokens 32]

For each artifact, on its random weights (seed 1234, as the GPU tests load them) and one random
prompt: greedy tokens from two launches of `--tokens` steps each, and from as many one-step
launches, with the logits of every single step kept and each step repeated once. Prints where
the three token lists first part, whether a repeated single step gave bit-identical logits, and
at the first parting the gap between the two best logits of the single step (a near tie that
any difference in the last bits may flip). The GPU test `test_token_loop_equals_single_steps`
asks the same of tokens only; this says which of the three differs and by how much.
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
    tok, stepped, logits, repeat_equal = int(prompt[-1]), [], [], True
    for _ in range(tokens):
        pos = engine.position
        nxt, out = engine.step(tok)
        engine.position = pos  # the same step again: the same KV entry is rewritten
        again, out_again = engine.step(tok)
        repeat_equal &= again == nxt and torch.equal(out, out_again)
        tok = nxt
        stepped.append(tok)
        logits.append(out.float().cpu())
    loop_loop = first_difference(loops[0], loops[1])
    loop_step = first_difference(loops[0], stepped)
    print(f"{artifact}: loop vs loop first differs at {loop_loop}, loop vs single steps at "
          f"{loop_step}; a single step repeated gives identical logits: {repeat_equal}")
    if loop_step is not None:
        top2 = logits[loop_step].topk(2).values
        print(f"  at step {loop_step}: loop token {loops[0][loop_step]}, single-step token "
              f"{stepped[loop_step]}, single step's best two logits {top2[0]:.6g} and "
              f"{top2[1]:.6g} (gap {top2[0] - top2[1]:.3g})")


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
