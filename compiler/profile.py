"""Where a decode step's time goes, from the kernel's own per-task timestamps.

`Engine.enable_profile(n)` makes the kernel stamp every task of the first n steps of a launch
with the GPU's globaltimer (ns) when the task starts, when its dependencies are met and when
it is done. This module turns those stamps (`[steps, tasks, 3]`) into a per-op table, with
identical layers folded (`layers.7.o_proj` counts as `o_proj`), and into the per-SM timeline
of one step (`tilertc.bench_charts.plot_timeline`). Everything but `profile_engine` runs on a
CPU.

A task's op is the op whose counter it signals (`signal` in the task table; the manifest's
`counters` names them); its SM is the CTA whose stream holds it (one CTA per SM).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from rich.console import Console
from rich.table import Table

from tilertc.backends.cuda.encode import FIELDS

if TYPE_CHECKING:
    from tilertc.engine import Engine

START, DEPS_MET, DONE = range(3)
LAYER_PREFIX = re.compile(r"^layers\.\d+\.")


def fold_layer(op: str) -> str:
    """`layers.12.ffn.down_proj` -> `ffn.down_proj`; ops outside the layers keep their name."""
    return LAYER_PREFIX.sub("", op)


@dataclass
class StepProfile:
    """The stamps of profiled steps with what each task is and where it ran."""

    stamps: np.ndarray  # [steps, tasks, 3] ns; a task that did not run is all zero
    ops: list[str]  # per task: its fused op
    ctas: np.ndarray  # per task: the CTA (SM) whose stream runs it
    # per op, the bytes the cost model counts it as reading (weights, and the KV cache at the
    # profiled context); empty when unknown
    op_bytes: dict[str, float] = field(default_factory=dict)
    # the stamp buffer's rows past the profiled steps ([spare, tasks, 3]), where a kernel
    # variant writes stamps of its own (tools/stream_probe.py); None without
    spare: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.stamps.ndim != 3 or self.stamps.shape[2] != 3:
            raise ValueError(f"stamps must be [steps, tasks, 3], not {self.stamps.shape}")
        if not (len(self.ops) == len(self.ctas) == self.stamps.shape[1]):
            raise ValueError("one op and one CTA per task are needed")

    def steps(self) -> list[int]:
        """The steps whose every task ran."""
        return [s for s in range(self.stamps.shape[0]) if (self.stamps[s, :, DONE] > 0).all()]

    def since_start(self, step: int) -> np.ndarray:
        """The stamps of `step` [tasks, 3] in ns since its first task started. The subtraction
        is done in integers: globaltimer readings (~1e18 ns) lose whole µs in a float64."""
        raw = self.stamps[step].astype(np.int64)
        return (raw - raw[:, START].min()).astype(np.float64)


def task_ops(tasks: np.ndarray, counters: list[str]) -> list[str]:
    """Each task's op: the name of the counter in its `signal` field."""
    return [counters[i] if 0 <= i < len(counters) else f"counter {i}"
            for i in tasks[:, FIELDS.index("signal")].tolist()]


def task_ctas(stream_offsets: np.ndarray, stream_tasks: np.ndarray, n_tasks: int) -> np.ndarray:
    """Each task's CTA, from the streams: CTA i runs stream_tasks[offsets[i]:offsets[i+1]]."""
    ctas = np.full(n_tasks, -1, dtype=np.int64)
    for cta in range(len(stream_offsets) - 1):
        ctas[stream_tasks[stream_offsets[cta]:stream_offsets[cta + 1]]] = cta
    return ctas


@dataclass(frozen=True)
class OpTime:
    """One fused op (all layers of it, folded) over the profiled steps, per step."""

    op: str
    ops_folded: int  # how many per-layer ops it stands for
    tasks: int  # tasks per step, over all the layers folded
    span_ns: float  # per step: first dependency met to last task done, summed over the layers
    mean_task_ns: float  # dependencies met to done, per task
    mean_wait_ns: float  # start to dependencies met, per task
    share: float  # span over the step's time
    floor_ns: float | None = None  # its bytes at the measured ceiling, summed over the layers
    # per step: its last task done after the median task's, summed over the layers: how long
    # the slowest tasks (SMs that drew less bandwidth, or started later) hold up what waits for
    # all of the op; what dealing the work out unevenly could win back
    tail_ns: float = 0.0
    # the op's task (its index among a layer's tasks of the op) done last in the most (step,
    # layer) pairs, and the share of them: near 100 % a matter of tiling or placement (a task
    # larger than the others, or behind another on its SM), not of the SMs' bandwidth
    usually_last: int = 0
    usually_last_share: float = 1.0


@dataclass(frozen=True)
class OpTable:
    rows: list[OpTime]  # in the order the ops first run in a step
    step_ns: float  # mean over the steps: first task start to last task done
    gap_ns: float  # mean over the steps: time inside no op's span (op boundaries, bubbles)
    steps: list[int]  # which steps were averaged

    def to_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "step_ns": self.step_ns, "gap_ns": self.gap_ns,
                "ops": [asdict(r) for r in self.rows]}


def uncovered_ns(t0: float, t1: float, spans: list[tuple[float, float]]) -> float:
    """How much of [t0, t1] lies outside every (begin, end) span."""
    covered, reach = 0.0, t0
    for begin, end in sorted(spans):
        begin, end = max(begin, reach), min(end, t1)
        if end > begin:
            covered += end - begin
            reach = end
    return (t1 - t0) - covered


def op_table(profile: StepProfile, skip_first: bool = True,
             bytes_per_s: float | None = None) -> OpTable:
    """The per-op table, averaged over the complete steps (without the first, which carries
    the launch, when there are others); given the measured bandwidth ceiling, each op's floor
    (its bytes, `profile.op_bytes`, at that ceiling), so that span - floor is what the op
    costs beyond its bytes."""
    steps = profile.steps()
    if skip_first and len(steps) > 1:
        steps = steps[1:]
    if not steps:
        raise ValueError("no profiled step ran to the end")
    tasks_of: dict[str, list[int]] = {}
    for i, op in enumerate(profile.ops):
        tasks_of.setdefault(op, []).append(i)
    stamps = np.stack([profile.since_start(s) for s in steps])  # [steps, tasks, 3]
    ends = stamps[:, :, DONE].max(1)
    step_ns = float(ends.mean())
    first = {op: stamps[:, idx, DEPS_MET].min(1) for op, idx in tasks_of.items()}
    last = {op: stamps[:, idx, DONE].max(1) for op, idx in tasks_of.items()}
    span = {op: float((last[op] - first[op]).mean()) for op in tasks_of}  # mean over the steps
    tail = {op: float((last[op] - np.median(stamps[:, idx, DONE], axis=1)).mean())
            for op, idx in tasks_of.items()}
    begin = {op: float(first[op].mean()) for op in tasks_of}
    last_task = {op: stamps[:, idx, DONE].argmax(1) for op, idx in tasks_of.items()}
    gap_ns = float(np.mean([uncovered_ns(0.0, ends[s],
                                         [(first[op][s], last[op][s]) for op in tasks_of])
                            for s in range(len(steps))]))
    folded: dict[str, list[str]] = {}
    for op in sorted(tasks_of, key=begin.__getitem__):
        folded.setdefault(fold_layer(op), []).append(op)
    rows = []
    for name, members in folded.items():
        idx = [i for op in members for i in tasks_of[op]]
        mine = stamps[:, idx]
        total = sum(span[op] for op in members)
        known = bytes_per_s and all(op in profile.op_bytes for op in members)
        lasts = Counter(int(i) for op in members for i in last_task[op])
        (usual, times), = lasts.most_common(1)
        rows.append(OpTime(name, len(members), len(idx), total,
                           float((mine[..., DONE] - mine[..., DEPS_MET]).mean()),
                           float((mine[..., DEPS_MET] - mine[..., START]).mean()),
                           total / step_ns,
                           sum(profile.op_bytes[op] for op in members) / bytes_per_s * 1e9
                           if known else None, sum(tail[op] for op in members), usual,
                           times / lasts.total()))
    return OpTable(rows, step_ns, gap_ns, steps)


def print_op_table(table: OpTable, console: Console) -> None:
    """The table as the terminal shows it; op spans overlap (pipelining) and leave gaps, so the
    shares need not add up to 100 %. `floor µs`: the op's bytes at the measured ceiling (blank
    where unknown); `tail µs`: its last task done after its median task (`OpTime.tail_ns`);
    `last task`: the task usually done last, and in what share of the steps and layers."""
    out = Table(title=f"one decode step: {table.step_ns / 1e3:.1f} µs, of which "
                      f"{table.gap_ns / 1e3:.1f} µs inside no op's span (mean of steps "
                      f"{', '.join(map(str, table.steps))}; kernel globaltimer stamps)",
                title_justify="left")
    for name in ("op", "×", "tasks", "span µs", "floor µs", "tail µs", "last task",
                 "mean task µs", "mean wait µs", "share %"):
        out.add_column(name, justify="left" if name == "op" else "right")
    for r in table.rows:
        out.add_row(r.op, str(r.ops_folded), str(r.tasks), f"{r.span_ns / 1e3:.1f}",
                    "" if r.floor_ns is None else f"{r.floor_ns / 1e3:.1f}",
                    f"{r.tail_ns / 1e3:.1f}",
                    f"{r.usually_last} ({r.usually_last_share:.0%})" if r.tasks > r.ops_folded
                    else "", f"{r.mean_task_ns / 1e3:.2f}",
                    f"{r.mean_wait_ns / 1e3:.2f}", f"{100 * r.share:.1f}")
    console.print(out)


def profile_engine(engine: Engine, first_token: int, steps: int,
                   spare_steps: int = 0) -> StepProfile:
    """Decode `steps` tokens after `first_token` from the engine's position with the kernel's
    stamps on, and return them (the position is left where it was), with the `spare_steps` rows
    of the stamp buffer past them, which no decoded step's task stamps reach
    (`StepProfile.spare`). Needs the GPU."""
    start = engine.position
    engine.enable_profile(steps + spare_steps)
    try:
        list(engine.generate([first_token], max_new_tokens=steps))
        stamps = engine.profile.cpu().numpy()
    finally:
        engine.enable_profile(0)
        engine.position = start
    tasks = engine.tasks.cpu().numpy()
    return StepProfile(stamps[:steps], task_ops(tasks, engine.m["counters"]),
                       task_ctas(engine.stream_offsets.cpu().numpy(),
                                 engine.stream_tasks.cpu().numpy(), tasks.shape[0]),
                       spare=stamps[steps:] if spare_steps else None)
