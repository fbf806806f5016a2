"""Time kernel variants whose output is wrong on purpose, on a GPU machine:

    python tools/time_ungated.py ROUNDS ARTIFACT [ARTIFACT ...]

An upper-bound experiment (a variant by `tools/kernel_variant.py` that skips work the answer
needs) cannot pass `tilertc bench`'s correctness gate, so this times each artifact as the bench
does (`bench.time_kernel`: a 1024-token prompt prefilled by the interpreter, 128 tokens of one
launch by the host clock) without it, on one set of random weights, the artifacts in turn
(reversed every other round; with one round, one engine loaded at a time). Prints each one's
median and mean ms/token. docs/performance.md's session 26 conversion figures were measured so.
Never a correctness check: the numbers are only times.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from tilertc.artifact import model_spec, read_manifest
from tilertc.bench import quiet_phase, round_order, time_kernel
from tilertc.engine import Engine
from tilertc.ir.build import build_graph
from tilertc.ir.weights import random_weights

CONTEXT, GEN = 1024, 128


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rounds", type=int)
    ap.add_argument("artifacts", nargs="+", type=Path)
    args = ap.parse_args()
    m = read_manifest(args.artifacts[0])
    spec = model_spec(m)
    weights = random_weights(build_graph(spec, m["max_seq_len"]), seed=0, device="cuda")
    prompt = torch.randint(0, spec.vocab_size, (CONTEXT,),
                           generator=torch.Generator().manual_seed(1))
    times: dict[Path, list[float]] = {a: [] for a in args.artifacts}
    engines: dict[Path, Engine] = {}
    for r in range(args.rounds):
        for a in round_order(args.artifacts, r):
            if a not in engines:
                if args.rounds == 1:  # one at a time: a large model's weights fit once
                    engines.clear()
                    torch.cuda.empty_cache()
                engines[a] = Engine.load(a, weights=weights, device="cuda:0")
            times[a] += time_kernel(engines[a], prompt, GEN, quiet_phase, str(a))
    for a, v in times.items():
        print(f"{a}: median {1e3 * statistics.median(v):.4f} mean {1e3 * statistics.mean(v):.4f}"
              " ms/token (ungated)")


if __name__ == "__main__":
    main()
