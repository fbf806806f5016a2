"""A layer's critical path on the GPU, op after op, from the kernel's own task stamps:

    python tools/layer_path.py ARTIFACT [--context N] [--steps N] [--step S | --later-steps]

Loads ARTIFACT with random weights, decodes a few steps with the stamps on from position N
(the cache's earlier rows are whatever the arena holds, which costs attention the time of a
real context) and prints, per op of a layer (layers folded: the mean over them), when its first
task started, its first and median task had their dependencies met, its median and last task
were done, in µs from the layer's first task start, and its mean task (dependencies met to
done). Where `tilertc bench --profile` gives each op's span, this shows how the ops follow one
another: how long an op waits for the last task of the one before, and how much of its
weights the loaders fetched before it could start (first start well before first met).
docs/performance.md, session 30, measured Qwen3-32B's attention this way. The last column
names the op's task that was done last in the most (step, layer) pairs, and in what share of
them (`tilertc bench --profile`'s `last task`): a task last in nearly all is a matter of
placement or tiling (session 37 found the q absorption's appending task and a shared-expert SM
with two tasks that way), one that changes from step to step the SMs' bandwidth.

The last two columns split an op's tail (its last task done after its median one) into what
its tasks' uneven sizes explain (the largest task's rows over the median's, times the median
task; more than they do, as a task's staging does not grow with its rows: DeepSeek-V3.2's
attn_in_proj gave 4.6 µs against a tail of 2.0-2.5, docs/performance.md, session 48) and the
rest: SMs of equal work that finished at different times, which only tasks handed out at run
time (an SM taking the next tile when it is free) could even out.

Below the table, the layer's end (its last task done) as the mean over the (layer, step)
samples with its standard error: two builds whose ends differ by less than about twice that
(two runs of one kernel moved ~1.5 us at 3 samples) are not told apart; `--steps 16` gives 15.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from stream_probe import STEPS, add_run_options, profile_at, random_engine

from tilertc.profile import DEPS_MET, DONE, START, StepProfile, op_table

LAYER_OP = re.compile(r"^layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class OpOnPath:
    """One op of a layer, mean over the layers, µs from the layer's first task start."""

    op: str
    first_start: float
    first_met: float
    median_met: float
    median_done: float
    last_done: float
    mean_task: float  # dependencies met to done
    from_sizes: float  # (largest task's rows / median task's - 1) x median task

    @property
    def tail(self) -> float:
        """How long after the median task the last one was done."""
        return self.last_done - self.median_done


def layer_tasks(profile: StepProfile) -> list[dict[str, list[int]]]:
    """Per layer, its tasks by op (the op's name past `layers.N.`)."""
    layers: dict[int, dict[str, list[int]]] = {}
    for task, name in enumerate(profile.ops):
        m = LAYER_OP.match(name)
        if m:
            layers.setdefault(int(m.group(1)), {}).setdefault(m.group(2), []).append(task)
    return list(layers.values())


def layer_ends(profile: StepProfile, steps: Sequence[int]) -> np.ndarray:
    """Each layer's end in each of `steps` (its last task done, µs from its first task start):
    the samples whose spread says how far two builds' means must differ to tell them apart."""
    layers = [[t for op in ops.values() for t in op] for ops in layer_tasks(profile)]
    ends = []
    for step in steps:
        stamps = profile.since_start(step)
        ends += [stamps[tasks, DONE].max() - stamps[tasks, START].min() for tasks in layers]
    return np.array(ends, dtype=np.float64) / 1e3


def layer_path(profile: StepProfile, steps: Sequence[int], rows: np.ndarray) -> list[OpOnPath]:
    """The ops of a layer in the order they run in one, each the mean over the layers and
    `steps`; a layer's time 0 is the first start of any of its tasks in that step. `rows`:
    each task's output rows (its size, for the tail's split)."""
    layers = layer_tasks(profile)
    per_op: dict[str, list[list[float]]] = {}
    for step in steps:
        stamps = profile.since_start(step)
        for ops in layers:
            t0 = min(stamps[tasks, START].min() for tasks in ops.values())
            for op, tasks in ops.items():
                s, size = stamps[tasks], rows[tasks]
                task = s[:, DONE] - s[:, DEPS_MET]
                per_op.setdefault(op, []).append([
                    s[:, START].min() - t0, s[:, DEPS_MET].min() - t0,
                    np.median(s[:, DEPS_MET]) - t0, np.median(s[:, DONE]) - t0,
                    s[:, DONE].max() - t0, float(np.mean(task)),
                    (size.max() / max(np.median(size), 1) - 1) * float(np.median(task))])
    means = {op: np.mean(np.array(r), axis=0) / 1e3 for op, r in per_op.items()}
    return [OpOnPath(op, *map(float, m)) for op, m in sorted(means.items(), key=lambda i: i[1][1])]


def task_rows(engine: Any) -> np.ndarray:
    """Each task's output rows (row1 - row0 of its row in the task table)."""
    fields = engine.m["task_fields"]
    tasks = engine.tasks.cpu().numpy()
    return tasks[:, fields.index("row1")] - tasks[:, fields.index("row0")]


def run(artifact: Path, steps: Sequence[int], context: int, decoded: int) -> None:
    engine = random_engine(artifact)
    profile = profile_at(engine, context, steps=decoded)
    which = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
    print(f"== {artifact}: {which} of {decoded}, context {context}; µs from the layer's first "
          "task start, mean over the layers" + (" and steps" if len(steps) > 1 else ""))
    print(f"  {'op':24s} {'1st start':>9s} {'1st met':>8s} {'med met':>8s} {'med done':>9s}"
          f" {'last done':>9s} {'task':>6s} {'tail':>5s} {'sizes':>5s}  usually last")
    last = {r.op: r for r in op_table(profile).rows}
    for r in layer_path(profile, steps, task_rows(engine)):
        print(f"  {r.op:24s} {r.first_start:9.2f} {r.first_met:8.2f} {r.median_met:8.2f}"
              f" {r.median_done:9.2f} {r.last_done:9.2f} {r.mean_task:6.2f} {r.tail:5.2f}"
              f" {r.from_sizes:5.2f}  task {last[r.op].usually_last}"
              f" ({last[r.op].usually_last_share:.0%})")
    ends = layer_ends(profile, steps)
    if len(ends) > 1:
        spread = ends.std(ddof=1)
        print(f"  the layer's end: {ends.mean():.2f} µs, standard error "
              f"{spread / len(ends) ** 0.5:.2f} ({len(ends)} layers x steps; standard deviation "
              f"{spread:.2f})")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path)
    add_run_options(parser)
    parser.add_argument("--later-steps", action="store_true",
                        help="the mean over every step but the first instead of --step's one "
                             "(a step's stamps move by ~0.5-1 us between steps)")
    parser.add_argument("--steps", type=int, default=STEPS,
                        help=f"steps decoded with the stamps on [default: {STEPS}]; more give "
                             "--later-steps more samples (an A/B of two builds: 16)")
    args = parser.parse_args(argv)
    if args.later_steps and args.steps < 2:
        parser.error("--later-steps needs --steps 2 or more: it leaves the first step out")
    if not args.later_steps and not 0 <= args.step < args.steps:
        parser.error(f"--step {args.step} is not one of the --steps {args.steps} steps (0-based)")
    steps = list(range(1, args.steps)) if args.later_steps else [args.step]
    run(args.artifact, steps, args.context, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
