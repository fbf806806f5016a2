"""The schedule verifier: run a program's per-SM instruction streams on the CPU and check them.

A schedule is right when, however the SMs interleave, no SM waits forever, no task reads a
region before the task that should write it in that step has done so (or after a later writer
overwrote it), and the logits of every step are the interpreter's.

The model is the kernel's (backends/cuda/decode/): each SM runs its stream in order once per
decode step; before the first task of step s > 0 it waits for the sampler's counter to reach s;
before a task it waits, for each (counter, per_step, lag) the kernel takes at the step's
position (`synchronization.waits_at`: a DSA attention skips its wait for a selection of every
token), until counter >= per_step * (step + 1 - lag); after it the task increments its
counter, or, for a chunked op, its group's arrival counter, and the arrival that completes the
step's count merges the group and increments the op's counter. Tasks are atomic here:
dependencies live at task boundaries.

What each task reads, writes and computes comes from `task_semantics.py`. A sequential pass
over the step (ops in program order) gives, for every region a task reads, the writer it must
see; the checks compare against that.

- Numeric mode (`-tiny` models): `interleavings` seeded random interleavings of `steps` steps
  (each draws SM speeds, so some SMs race ahead), random weights, a prompt prefilled by the
  interpreter. Every per-step buffer is poisoned (NaN, and marked unwritten) when a step
  begins; every read is checked against the writer it must see; the logits of each step must
  equal the interpreter's, teacher-forced with the sampled tokens, and be identical across
  interleavings. The structural checks run too.
- Structural mode (any size, no numerics): one run of one step (which decides every step, see
  `structural`). Whether the streams deadlock does not depend on the interleaving (counters
  only grow and waits are thresholds, so an SM that may proceed stays able to), so one run
  decides it. Vector clocks over that run give the
  happens-before order of the waits, signals and program order: each region a task reads must
  be written by a task that happens before it, each overwrite must happen after the reads of
  the old value, and the sampler of a step must happen after every task of the step, so that
  step s + 1 (which waits for it) may reuse every buffer.

`verify` raises `VerificationError` (with `kind`: deadlock, read_before_write, overwrite,
counter, sampler, mismatch) or returns a `VerifyReport`.
"""

from __future__ import annotations

import heapq
import random
import time
from bisect import bisect_left, bisect_right
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from tilertc.ir.build import build_graph
from tilertc.ir.graph import Op, TensorKind
from tilertc.ir.interpreter import Interpreter, Step
from tilertc.ir.weights import random_weights
from tilertc.passes import task_semantics_mla, task_semantics_moe  # noqa: F401 (register)
from tilertc.passes.program import Program
from tilertc.passes.synchronization import waits_at
from tilertc.passes.task_semantics import KINDS, Access

POISON = -2  # mark: never written (or poisoned when a step began)
PREFILL = -3  # mark: written by the prefill or the host before the run
OWN = -4  # expected writer: the reading task itself, earlier in the task


class VerificationError(Exception):
    """The schedule is wrong; `kind` says how, the message says where."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class VerifyReport:
    mode: str
    tasks: int
    steps: int
    interleavings: int
    seconds: float
    logits: list[torch.Tensor] = field(default_factory=list)  # numeric: per step
    tokens: list[int] = field(default_factory=list)


# -- actors and the sequential plan of one step --------------------------------------------

@dataclass
class Merge:
    """The merge of one group of a chunked op, done by whichever chunk arrives last."""

    op: str
    group: int
    arrive: int  # arrival counter
    signal: int  # the op's counter


@dataclass
class Read:
    """A region an actor reads that the step writes: the pieces (lo, hi, writer) that a
    sequential run of the step would have it see (shared between readers of equal regions),
    and the adds (lo, hi, adder) onto them it must see too (a split-K FFN's sum)."""

    buffer: str
    row: int | None
    lo: int
    hi: int
    pieces: tuple[tuple[int, int, int], ...]
    adds: tuple[tuple[int, int, int], ...] = ()

    @property
    def writers(self) -> tuple[tuple[int, int, int], ...]:
        """Every actor whose write or add the reader must see."""
        return (*self.pieces, *self.adds)


class Plan:
    """Actors (tasks, then merges) of a program, and what each must see in one step at `pos`."""

    def __init__(self, program: Program, pos: int) -> None:
        self.program, self.pos = program, pos
        self.tasks = program.tasks
        self.merges: list[Merge] = []
        self.merge_of: dict[int, int] = {}  # arrival counter -> merge index
        for t in self.tasks:
            if t.arrive >= 0 and t.arrive not in self.merge_of:
                self.merge_of[t.arrive] = len(self.merges)
                self.merges.append(Merge(t.op, t.rows[0], t.arrive, t.signal))
        self.sm_of = [t.sm for t in self.tasks] + [-1] * len(self.merges)
        self.slot = [0] * len(self.tasks)  # 1-based position in its SM's stream
        for stream in program.streams:
            for i, tid in enumerate(stream):
                self.slot[tid] = i + 1
        self.accesses = [self._accesses(a) for a in range(self.n_actors)]
        self.waits = [waits_at(program, t, pos) for t in self.tasks]  # as the kernel takes them
        self.reads: list[list[Read]] = [[] for _ in range(self.n_actors)]
        # reads of rows written in earlier steps: (access, rows of it this step writes)
        self.history: list[list[tuple[Access, set[int]]]] = [[] for _ in range(self.n_actors)]
        self.after: list[set[int]] = [set() for _ in range(self.n_actors)]  # must happen before
        self.static_errors: list[tuple[int, str]] = []
        self._sequential_pass()

    @property
    def n_actors(self) -> int:
        return len(self.tasks) + len(self.merges)

    def name(self, actor: int) -> str:
        if actor < len(self.tasks):
            t = self.tasks[actor]
            return f"{t.key} (SM {t.sm})"
        m = self.merges[actor - len(self.tasks)]
        return f"{m.op} merge of group {m.group}"

    def _accesses(self, actor: int) -> list[Access]:
        if actor < len(self.tasks):
            t = self.tasks[actor]
            return KINDS[t.opcode].accesses(self.program, t, self.pos)
        m = self.merges[actor - len(self.tasks)]
        op = self.program.graph.op(m.op)
        return KINDS[op.opcode].merge_accesses(self.program, op, m.group, self.pos)

    def order(self) -> list[int]:
        """Actors in sequential order: ops in program order, tasks by index, then merges."""
        by_op: dict[str, list[int]] = defaultdict(list)
        for i, t in enumerate(self.tasks):
            by_op[t.op].append(i)
        for m, merge in enumerate(self.merges):
            by_op[merge.op].append(len(self.tasks) + m)
        return [a for op in self.program.graph.ops() for a in by_op[op.name]]

    def _op_of(self, actor: int) -> str:
        return self.tasks[actor].op if actor < len(self.tasks) else \
            self.merges[actor - len(self.tasks)].op

    @staticmethod
    def _rows(acc: Access) -> range | list[None]:
        return range(*acc.rows) if acc.rows else [None]

    def _written(self, key: tuple[str, int | None], lo: int, hi: int) -> bool:
        """Whether the step writes all of [lo, hi) of a buffer (row) at all (for messages)."""
        every = Pieces()
        for actor, accs in enumerate(self.accesses):
            for acc in accs:
                if acc.write and acc.buffer == key[0] and key[1] in self._rows(acc):
                    every.write(acc.lo, acc.hi, actor)
        return every.covers(lo, hi)

    def _sequential_pass(self) -> None:
        rows_written: dict[str, set[int]] = defaultdict(set)
        writer_ops: dict[tuple[str, int | None], set[str]] = defaultdict(set)
        for actor, accs in enumerate(self.accesses):
            for acc in accs:
                if acc.write:
                    for row in self._rows(acc):
                        writer_ops[acc.buffer, row].add(self._op_of(actor))
                        if row is not None:
                            rows_written[acc.buffer].add(row)
        # Only regions that more than one op writes in a step can be overwritten while a
        # reader still needs them; only there are readers tracked (for the WAR check).
        pieces = {key: Pieces(track_readers=len(ops) > 1) for key, ops in writer_ops.items()}
        for actor in self.order():
            for acc in self.accesses[actor]:
                if acc.write:
                    for row in self._rows(acc):
                        p = pieces[acc.buffer, row]
                        if acc.add and not p.covers(acc.lo, acc.hi):
                            self.static_errors.append(
                                (actor, f"{self.name(actor)} adds into {acc.buffer}"
                                        f"[{acc.lo}:{acc.hi}] before its start value is written"))
                        self.after[actor].update(p.write(acc.lo, acc.hi, actor, acc.add))
                    continue
                rows = self._rows(acc)
                if acc.rows:
                    rows = sorted(r for r in rows_written[acc.buffer] if r in rows)
                    if len(rows) < len(self._rows(acc)):
                        self.history[actor].append((acc, set(rows)))
                for row in rows:
                    key = (acc.buffer, row)
                    found, gaps, adds = pieces[key].read(acc.lo, acc.hi, actor) \
                        if key in pieces else ((), [(acc.lo, acc.hi)], ())
                    if found:
                        self.reads[actor].append(Read(acc.buffer, row, acc.lo, acc.hi, found,
                                                      adds))
                    for lo, hi in gaps:
                        what = "which a later op of the step writes" \
                            if self._written(key, lo, hi) else "which no task writes in a step"
                        where = f" row {row}" if row is not None else ""
                        self.static_errors.append(
                            (actor, f"{self.name(actor)} reads {acc.buffer}{where}[{lo}:{hi}], "
                                    f"{what}, before it is written"))
            self.after[actor].discard(actor)


class Pieces:
    """Disjoint pieces [lo, hi) of one buffer (row) with the last writer of each, the actors
    that added onto it since (a split-K FFN's sum) and, if tracked, who read it since. A
    sequential pass writes and reads them in program order."""

    def __init__(self, track_readers: bool = False) -> None:
        self.track = track_readers
        self.los: list[int] = []
        self.items: list[list] = []  # [lo, hi, writer, readers, adders]
        self.seen: dict[tuple[int, int], tuple] = {}  # reads since the last write

    def _cut(self, x: int) -> None:
        i = bisect_right(self.los, x) - 1
        if i >= 0:
            lo, hi, w, readers, adders = self.items[i]
            if lo < x < hi:
                self.items[i] = [lo, x, w, readers, adders]
                self.items.insert(i + 1, [x, hi, w, list(readers), list(adders)])
                self.los.insert(i + 1, x)

    def _span(self, lo: int, hi: int) -> tuple[int, int]:
        self._cut(lo)
        self._cut(hi)
        return bisect_left(self.los, lo), bisect_left(self.los, hi)

    def covers(self, lo: int, hi: int) -> bool:
        i, j = self._span(lo, hi)
        return sum(p[1] - p[0] for p in self.items[i:j]) == hi - lo

    def read(self, lo: int, hi: int, reader: int) -> tuple[tuple[tuple[int, int, int], ...],
                                                          list[tuple[int, int]],
                                                          tuple[tuple[int, int, int], ...]]:
        """The pieces a read of [lo, hi) sees, the gaps no earlier write covers, and the adds
        onto the pieces (lo, hi, adder)."""
        if (lo, hi) in self.seen and not self.track:
            return self.seen[lo, hi]
        i, j = self._span(lo, hi)
        found, gaps, adds, at = [], [], [], lo
        for p in self.items[i:j]:
            if p[0] > at:
                gaps.append((at, p[0]))
            found.append((p[0], p[1], p[2]))
            adds += [(p[0], p[1], a) for a in p[4]]
            if self.track:
                p[3].append(reader)
            at = p[1]
        if at < hi:
            gaps.append((at, hi))
        self.seen[lo, hi] = (tuple(found), gaps, tuple(adds))
        return self.seen[lo, hi]

    def write(self, lo: int, hi: int, writer: int, add: bool = False) -> set[int]:
        """Record the write (or, with `add`, an add onto the pieces there); returns the actors
        that must happen before it (WAR, WAW; an add: the pieces' writers and readers, not the
        other adders, whose adds commute with it)."""
        self.seen.clear()
        i, j = self._span(lo, hi)
        before = set()
        for p in self.items[i:j]:
            before.add(p[2])
            before.update(p[3])
            if add:
                p[4].append(writer)
            else:
                before.update(p[4])
        if add:
            return before
        del self.items[i:j], self.los[i:j]
        self.items.insert(i, [lo, hi, writer, [], []])
        self.los.insert(i, lo)
        return before


# -- the machine: SMs over their streams, counters -------------------------------------------

class Machine:
    """The SMs of one kernel launch running `steps` steps, one task at a time.

    `run(choose, on_task, on_merge)` executes until no SM can proceed; `choose` picks the next
    SM among the ready ones. Afterwards `stuck()` lists the SMs that did not finish.

    Under tensor parallelism the machine runs every rank's copy of the streams, each with its
    own counters: SM `r * n + s` is SM s of rank r, counter `r * c + i` is rank r's counter i.
    A task with an exchange (passes/synchronization.py) runs in two moves: it publishes
    (arrives on its exchange counter on every rank), then, once its own rank's exchange
    counter reaches tp per step, it completes. `on_task` and `on_merge` see rank 0's actors
    only (the ranks' streams and plans are the same).
    """

    def __init__(self, program: Program, plans: list[Plan], steps: int) -> None:
        # one plan a step: a step's position decides the waits its tasks take (Plan.waits)
        self.program, self.plans, self.plan, self.steps = program, plans, plans[0], steps
        self.ranks, self.n_sm, self.n_counters = program.tp, len(program.streams), \
            len(program.counters)
        self.streams = program.streams * self.ranks
        self.per_step = [c.per_step for c in program.counters] * self.ranks
        self.sampler = next(i for i, c in enumerate(program.counters)
                            if c.name in program.graph.nx
                            and program.graph.op(c.name).opcode == "argmax")
        self.counters = [0] * len(self.per_step)
        self.step = [0] * len(self.streams)
        self.head = [0] * len(self.streams)
        self.published = [False] * len(self.streams)  # the head task's exchange is published
        self.ready: set[int] = set()
        self.waiting: dict[int, list[tuple[int, int]]] = defaultdict(list)  # heaps (target, sm)
        for sm in range(len(self.streams)):
            self._place(sm)

    def finished(self, sm: int) -> bool:
        return self.step[sm] >= self.steps or not self.streams[sm]

    def blocking(self, sm: int) -> tuple[int, int, str] | None:
        """The first unmet wait of the SM's next task: (counter, target, what waits)."""
        step, head, base = self.step[sm], self.head[sm], sm // self.n_sm * self.n_counters
        if head == 0 and step > 0 and self.counters[base + self.sampler] < step:
            return base + self.sampler, step, "the step gate"
        tid = self.streams[sm][head]
        task = self.program.tasks[tid]
        if self.published[sm]:
            want = self.ranks * (step + 1)
            if self.counters[base + task.exchange] < want:
                return base + task.exchange, want, f"{task.key}'s exchange"
            return None
        for counter, per_step, lag in self.plans[step].waits[tid]:
            want = per_step * (step + 1 - lag)
            if want > 0 and self.counters[base + counter] < want:
                return base + counter, want, task.key
        return None

    def _place(self, sm: int) -> None:
        if self.finished(sm):
            return
        b = self.blocking(sm)
        if b is None:
            self.ready.add(sm)
        else:
            heapq.heappush(self.waiting[b[0]], (b[1], sm))

    def _bump(self, counter: int) -> None:
        self.counters[counter] += 1
        heap = self.waiting.get(counter)
        while heap and heap[0][0] <= self.counters[counter]:
            self._place(heapq.heappop(heap)[1])

    def run(self, choose, on_task, on_merge) -> None:
        tasks = self.program.tasks
        while self.ready:
            sm = choose(self.ready)
            self.ready.discard(sm)
            step, tid = self.step[sm], self.streams[sm][self.head[sm]]
            t = tasks[tid]
            rank0, base = sm < self.n_sm, sm // self.n_sm * self.n_counters
            if t.exchange >= 0 and not self.published[sm]:  # its part to every rank
                self.published[sm] = True
                for r in range(self.ranks):
                    self._bump(r * self.n_counters + t.exchange)
                self._place(sm)
                continue
            self.published[sm] = False
            if rank0:
                on_task(tid, step)
            if t.arrive >= 0:
                before = self.counters[base + t.arrive]
                self._bump(base + t.arrive)
                if before == (step + 1) * self.per_step[t.arrive] - 1:
                    if rank0:
                        on_merge(self.plan.merge_of[t.arrive], step)
                    self._bump(base + t.signal)
            else:
                self._bump(base + t.signal)
            self.head[sm] += 1
            if self.head[sm] == len(self.streams[sm]):
                self.head[sm], self.step[sm] = 0, step + 1
            self._place(sm)

    def stuck(self) -> list[int]:
        return [sm for sm in range(len(self.streams)) if not self.finished(sm)]

    def done(self, task: int, step: int, rank: int = 0) -> bool:
        sm = self.program.tasks[task].sm + rank * self.n_sm
        return self.step[sm] > step or (self.step[sm] == step and
                                        self.head[sm] >= self.plan.slot[task])

    def deadlock_report(self) -> str:
        """The cycle of waits among the stuck SMs, each link naming the counter and the task
        that would signal it."""
        tasks, counters = self.program.tasks, self.program.counters
        signallers: dict[int, list[int]] = defaultdict(list)
        for i, t in enumerate(tasks):
            signallers[t.arrive if t.arrive >= 0 else t.signal].append(i)
            if t.exchange >= 0:
                signallers[t.exchange].append(i)
        exchanges = {t.exchange for t in tasks if t.exchange >= 0}
        merges_of: dict[int, list[int]] = defaultdict(list)
        for m in self.plan.merges:
            merges_of[m.signal].append(m.arrive)
        links: dict[int, tuple[str, int | None]] = {}
        for sm in self.stuck():
            g_counter, want, who = self.blocking(sm)
            rank, counter = divmod(g_counter, self.n_counters)
            per = self.per_step[counter]
            step = -(-want // per) - 1 if per else 0
            where = f" of rank {rank}" if self.ranks > 1 else ""
            head = f"SM {sm % self.n_sm}{where} ({who}, step {self.step[sm]}) waits for counter " \
                   f"{counter} '{counters[counter].name}' to reach {want} (it is at " \
                   f"{self.counters[g_counter]})"
            # an exchange counter is signalled by its task on every rank, others by this rank's
            ranks = range(self.ranks) if counter in exchanges else [rank]
            missing = [(i, r) for c in [counter, *merges_of.get(counter, [])]
                       for i in signallers.get(c, []) for r in ranks
                       if not self.done(i, step, r)]
            if not missing:
                links[sm] = (f"{head}, but no task left would signal it: {per} per step are "
                             f"expected and {len(signallers.get(counter, []))} tasks signal it",
                             None)
                continue
            (xi, xr) = missing[0]
            x, xsm = tasks[xi], tasks[xi].sm + xr * self.n_sm
            blocker = tasks[self.streams[xsm][self.head[xsm]]]
            rel = "which is where that SM is stuck" if blocker is x else \
                f"behind {blocker.key}, where that SM is stuck"
            links[sm] = (f"{head}; {x.key} would signal it, on SM {x.sm}"
                         f"{f' of rank {xr}' if self.ranks > 1 else ''}, {rel}", xsm)
        sm, seen = min(links), []
        while sm is not None and sm not in seen:
            seen.append(sm)
            sm = links[sm][1]
        chain = seen[seen.index(sm):] if sm is not None else seen
        kind = "cycle of waits" if sm is not None else "chain of waits"
        lines = [f"  {links[s][0]}" for s in chain]
        if sm is not None:
            lines.append(f"  (back to SM {sm})")
        return (f"deadlock: no SM can make progress ({len(links)} stuck). The {kind}:\n" +
                "\n".join(lines))


# -- structural checks ---------------------------------------------------------------------

def check_counters(program: Program, plan: Plan) -> None:
    """Every counter's per-step count must be what its signallers give it in one step."""
    got: dict[int, int] = defaultdict(int)
    for t in program.tasks:
        if t.arrive >= 0:
            got[t.arrive] += 1
        else:
            got[t.signal] += 1
        if t.exchange >= 0:
            got[t.exchange] += program.tp  # one arrival from the task's copy on every rank
    for m in plan.merges:
        got[m.signal] += 1
    for i, c in enumerate(program.counters):
        if got[i] != c.per_step:
            raise VerificationError("counter", f"counter {i} '{c.name}' expects {c.per_step} "
                                    f"increments per step but {got[i]} tasks give it one")


def preflight(program: Program, plan: Plan) -> None:
    """What needs no run: counter counts, and reads that no earlier op of the step writes."""
    check_counters(program, plan)
    if plan.static_errors:
        raise VerificationError("read_before_write", plan.static_errors[0][1])


def structural(program: Program, plan: Plan) -> None:
    """Deadlock freedom and happens-before coverage, from one run of one step.

    One step decides every step: a step's tasks never wait for a later step's, so step 0 runs
    to completion on its own if it can; counters then stand at exactly one step's count each
    (`check_counters`), the gate and every lag >= 1 wait of step 1 are met by step 0, and its
    other waits are step 0's shifted by one step's count, so step 1 replays step 0, and so on.
    """
    preflight(program, plan)
    nsm, ntasks = len(program.streams), len(program.tasks)
    cols = nsm + len(plan.merges)
    sm_vc = np.zeros((nsm, cols), dtype=np.int32)
    joins: dict[int, np.ndarray] = {}
    group_vc = np.zeros((len(plan.merges), cols), dtype=np.int32)
    machine = Machine(program, [plan], 1)
    sampler_vc: list[np.ndarray] = []

    def knows(vc: np.ndarray, actor: int) -> bool:
        if actor < ntasks:
            return vc[plan.sm_of[actor]] >= plan.slot[actor]
        return vc[nsm + actor - ntasks] >= 1

    needs: dict[tuple[tuple[int, int], int], np.ndarray] = {}
    writers: dict[tuple[int, int], set[int]] = {}

    def need(r: Read, actor: int) -> np.ndarray:
        """Per column, the stream slot a reader must know of to have seen r's writers."""
        rid = (id(r.pieces), id(r.adds))
        if rid not in writers:
            writers[rid] = {w for _, _, w in r.writers}
        key = (rid, actor if actor in writers[rid] else -1)
        if key not in needs:
            vec = np.zeros(cols, dtype=np.int32)
            for _, _, w in r.writers:
                if w == actor:
                    continue
                col = plan.sm_of[w] if w < ntasks else nsm + w - ntasks
                vec[col] = max(vec[col], plan.slot[w] if w < ntasks else 1)
            needs[key] = vec
        return needs[key]

    def check(actor: int, vc: np.ndarray) -> None:
        for r in plan.reads[actor]:
            if (vc >= need(r, actor)).all():
                continue
            w = next(w for _, _, w in r.writers if w != actor and not knows(vc, w))
            where = f" row {r.row}" if r.row is not None else ""
            raise VerificationError(
                "read_before_write",
                f"read before write: {plan.name(actor)} reads {r.buffer}{where}"
                f"[{r.lo}:{r.hi}], written in the same step by {plan.name(w)}, but does not "
                "wait (directly or through other tasks) for it")
        for other in plan.after[actor]:
            if not knows(vc, other):
                raise VerificationError(
                    "overwrite", f"{plan.name(actor)} overwrites a region that "
                    f"{plan.name(other)} reads or writes earlier in the step, without waiting "
                    "for it")

    def on_task(tid: int, step: int) -> None:
        t = program.tasks[tid]
        vc = sm_vc[t.sm].copy()
        for counter, _, lag in plan.waits[tid]:
            if lag == 0 and counter in joins:
                np.maximum(vc, joins[counter], out=vc)
        check(tid, vc)
        vc[t.sm] = plan.slot[tid]
        sm_vc[t.sm] = vc
        if t.arrive >= 0:
            np.maximum(group_vc[plan.merge_of[t.arrive]], vc, out=group_vc[plan.merge_of[t.arrive]])
        else:
            joins.setdefault(t.signal, np.zeros(cols, dtype=np.int32))
            np.maximum(joins[t.signal], vc, out=joins[t.signal])
        if t.signal == machine.sampler:
            sampler_vc.append(vc.copy())

    def on_merge(m: int, step: int) -> None:
        vc = group_vc[m].copy()
        vc[nsm + m] = 1
        check(ntasks + m, vc)
        joins.setdefault(plan.merges[m].signal, np.zeros(cols, dtype=np.int32))
        np.maximum(joins[plan.merges[m].signal], vc, out=joins[plan.merges[m].signal])

    machine.run(lambda ready: next(iter(ready)), on_task, on_merge)
    if machine.stuck():
        raise VerificationError("deadlock", machine.deadlock_report())
    lengths = np.array([len(s) for s in program.streams] + [1] * len(plan.merges))
    behind = np.nonzero(sampler_vc[0] < lengths)[0] if sampler_vc else np.arange(cols)
    if len(behind):
        c = int(behind[0])
        what = (plan.name(program.streams[c][-1]) if c < nsm
                else plan.name(ntasks + c - nsm))
        raise VerificationError(
            "sampler", f"{what} does not happen before the sampler of its step, which the next "
            "step waits for: the next step may overwrite buffers it still uses")


# -- numeric run ---------------------------------------------------------------------------

class Memory:
    """The verifier's global memory: values plus, per element, the step and actor of the last
    write (`POISON` for none); of a fixed-point buffer (a split-K FFN's sum, int64 values as
    the kernel's) also how many adds followed that write (`adds`)."""

    def __init__(self, program: Program, state: dict[str, torch.Tensor], first_token: int,
                 pos: int) -> None:
        g = program.graph
        self.values: dict[str, torch.Tensor] = {}
        self.step_mark: dict[str, torch.Tensor] = {}
        self.actor_mark: dict[str, torch.Tensor] = {}
        self.per_step: list[str] = []
        self.adds: dict[str, torch.Tensor] = {}
        for t in g.tensors.values():
            if t.kind in (TensorKind.ACTIVATION, TensorKind.OUTPUT, TensorKind.SCRATCH):
                dtype = torch.int64 if t.dtype in ("int64", "fx64") else torch.float32
                self._alloc(t.name, (t.numel,), dtype)
                self.per_step.append(t.name)
                if t.dtype == "fx64":
                    self.adds[t.name] = torch.zeros(t.numel, dtype=torch.int32)
            elif t.kind is TensorKind.KV_CACHE:
                rows = state[t.name].reshape(t.shape[0], -1)
                self._alloc(t.name, rows.shape, torch.float32)
                self.values[t.name][:pos] = rows[:pos]
                self.step_mark[t.name][:pos] = -1
                self.actor_mark[t.name][:pos] = PREFILL
        for name, b in program.buffers.items():
            if name not in g.tensors:
                self._alloc(name, (b.numel,), torch.float32)
                self.per_step.append(name)
        self._alloc("tokens", (g.attrs["max_seq_len"] + 1, 1), torch.int64)
        self.values["tokens"][pos] = first_token
        self.step_mark["tokens"][pos], self.actor_mark["tokens"][pos] = -1, PREFILL

    def _alloc(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.values[name] = torch.full(shape, _poison(dtype), dtype=dtype)
        self.step_mark[name] = torch.full(shape, -1, dtype=torch.int32)
        self.actor_mark[name] = torch.full(shape, POISON, dtype=torch.int32)

    def begin_step(self, step: int) -> None:
        for name in self.per_step:
            self.values[name].fill_(_poison(self.values[name].dtype))
            self.step_mark[name].fill_(step)
            self.actor_mark[name].fill_(POISON)
        for adds in self.adds.values():
            adds.zero_()


def _poison(dtype: torch.dtype) -> float:
    return float("nan") if dtype.is_floating_point else -(2**62)


class TaskContext:
    """`task_semantics.Context` over a `Memory`: reads and writes only what the actor declared."""

    def __init__(self, program: Program, interp: Interpreter, mem: Memory) -> None:
        self.program, self.interp, self.mem = program, interp, mem
        self.sources = {op.name: op for op in interp.graph.ops()}
        self.pos = self.step = self.actor = 0
        self.declared: list[Access] = []
        self.istep = Step(torch.tensor([0]), {}, torch.float32)

    def begin(self, actor: int, declared: list[Access], step: int, pos: int) -> None:
        self.actor, self.declared, self.step, self.pos = actor, declared, step, pos
        self.istep = Step(torch.tensor([pos]), {}, torch.float32)

    def _check(self, write: bool, buffer: str, lo: int, hi: int,
               rows: tuple[int, int] | None, add: bool = False) -> None:
        for a in self.declared:
            if a.write == write and a.add == add and a.buffer == buffer and a.lo <= lo and \
                    hi <= a.hi and (rows is None or (a.rows[0] <= rows[0] and
                                                     rows[1] <= a.rows[1])):
                return
        kind = "adds into" if add else "writes" if write else "reads"
        raise AssertionError(f"verifier: actor {self.actor} {kind} {buffer}[{lo}:{hi}] rows "
                             f"{rows}, which its task semantics do not declare")

    def read(self, buffer: str, lo: int, hi: int,
             rows: tuple[int, int] | None = None) -> torch.Tensor:
        self._check(False, buffer, lo, hi, rows)
        v = self.mem.values[buffer]
        return (v[rows[0]:rows[1], lo:hi] if rows else v[lo:hi]).clone()

    def write(self, buffer: str, lo: int, values: torch.Tensor, row: int | None = None) -> None:
        hi = lo + values.numel()
        self._check(True, buffer, lo, hi, None if row is None else (row, row + 1))
        m = self.mem
        idx = (row, slice(lo, hi)) if row is not None else slice(lo, hi)
        m.values[buffer][idx] = values.reshape(-1).to(m.values[buffer].dtype)
        m.step_mark[buffer][idx] = self.step
        m.actor_mark[buffer][idx] = self.actor
        if buffer in m.adds:
            m.adds[buffer][idx] = 0

    def add(self, buffer: str, lo: int, values: torch.Tensor) -> None:
        """Adds onto a fixed-point buffer's elements, which this step's start value must hold
        already; the mark stays the start value's writer, and the adds are counted."""
        hi = lo + values.numel()
        self._check(True, buffer, lo, hi, None, add=True)
        m = self.mem
        ms, ma = m.step_mark[buffer][lo:hi], m.actor_mark[buffer][lo:hi]
        if bool(((ms != self.step) | (ma == POISON)).any()):
            raise VerificationError("read_before_write", f"in step {self.step}: actor "
                                    f"{self.actor} adds into {buffer}[{lo}:{hi}] before its "
                                    "start value is written")
        m.values[buffer][lo:hi] += values.reshape(-1).to(m.values[buffer].dtype)
        m.adds[buffer][lo:hi] += 1

    def weight(self, name: str) -> torch.Tensor:
        return self.interp.weight(name)

    def source(self, name: str) -> Op:
        return self.sources[name]


def _expected_writers(plan: Plan, actor: int) -> list[tuple[str, int | None, int, int,
                                                            torch.Tensor, torch.Tensor | None]]:
    """The actor's reads of this step's writes as runs of (buffer, row, lo, hi, the writer
    each element must hold, and for a buffer that is added into, the adds it must hold),
    built once per plan."""
    cache = plan.__dict__.setdefault("_expected", {})
    if actor not in cache:
        cache[actor] = []
        for r in plan.reads[actor]:
            writers = torch.full((r.hi - r.lo,), OWN, dtype=torch.int32)
            for lo, hi, w in r.pieces:
                if w != actor:
                    writers[lo - r.lo:hi - r.lo] = w
            adds = None
            if r.adds:
                adds = torch.zeros(r.hi - r.lo, dtype=torch.int32)
                for lo, hi, _ in r.adds:
                    adds[lo - r.lo:hi - r.lo] += 1
            cache[actor].append((r.buffer, r.row, r.lo, r.hi, writers, adds))
    return cache[actor]


def _check_reads(plan: Plan, mem: Memory, actor: int, step: int) -> None:
    for buffer, row, lo, hi, writers, adds in _expected_writers(plan, actor):
        idx = (row, slice(lo, hi)) if row is not None else slice(lo, hi)
        ms, ma = mem.step_mark[buffer][idx], mem.actor_mark[buffer][idx]
        bad = ((ms != step) | (ma != writers)) & (writers != OWN)
        if adds is not None and bool((mem.adds[buffer][idx] != adds).any()):
            i = int((mem.adds[buffer][idx] != adds).nonzero()[0, 0])
            raise VerificationError(
                "read_before_write", f"in step {step}: {plan.name(actor)} reads {buffer}"
                f"[{lo}:{hi}] after {int(mem.adds[buffer][idx][i])} of the {int(adds[i])} "
                f"adds into element {lo + i}")
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            where = f" row {row}" if row is not None else ""
            raise VerificationError(
                "read_before_write" if ma[i] == POISON or ms[i] < step else "overwrite",
                f"in step {step}: {plan.name(actor)} reads {buffer}{where}[{lo}:{hi}] before "
                f"{plan.name(int(writers[i]))} wrote it: element {lo + i} "
                f"{_describe(plan, int(ms[i]), int(ma[i]), step)}")
    for a, current in plan.history[actor]:
        ms = mem.step_mark[a.buffer][a.rows[0]:a.rows[1], a.lo:a.hi]
        ma = mem.actor_mark[a.buffer][a.rows[0]:a.rows[1], a.lo:a.hi]
        bad = ((ma == POISON) | (ms >= step)).nonzero()
        bad = [(int(i), int(j)) for i, j in bad if a.rows[0] + int(i) not in current]
        if bad:
            i, j = bad[0]
            raise VerificationError(
                "read_before_write", f"in step {step}: {plan.name(actor)} reads {a.buffer} row "
                f"{a.rows[0] + i} written in an earlier step, but it "
                f"{_describe(plan, int(ms[i, j]), int(ma[i, j]), step)}")


def _describe(plan: Plan, ms: int, ma: int, step: int) -> str:
    if ma == POISON:
        if ms > step:
            return f"was poisoned when step {ms} began"
        return "was never written" if ms < step else "is not yet written in this step"
    if ma == PREFILL:
        return "holds the prefill's value"
    return f"holds the value {plan.name(ma)} wrote in step {ms}"


def numeric(program: Program, plan_at, steps: int, interleavings: int, seed: int,
            prompt_len: int) -> tuple[list[torch.Tensor], list[int]]:
    """Run the streams in random interleavings; returns per-step logits and tokens."""
    spec, seq = program.spec, program.graph.attrs["max_seq_len"]
    source = build_graph(spec, seq)
    weights = random_weights(source, seed)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, spec.vocab_size, (prompt_len,), generator=gen)
    start = prompt_len - 1
    reference = Interpreter(source, weights)
    if start:
        reference.run(prompt[:start], torch.arange(start))
    prefilled = {k: v.clone() for k, v in reference.state.items()}
    plans = [plan_at(start + s) for s in range(steps)]
    first: tuple[list[torch.Tensor], list[int]] | None = None
    for i in range(interleavings):
        rng = random.Random(seed * 1000 + i)
        speed = [rng.expovariate(1.0) if i else 1.0 for _ in program.streams]
        mem = Memory(program, prefilled, int(prompt[-1]), start)
        ctx = TaskContext(program, reference, mem)
        logits, tokens = [None] * steps, [0] * steps
        done = [0] * steps
        begun = [False] * steps
        machine = Machine(program, plans, steps)

        def on_task(tid: int, step: int, mem=mem, ctx=ctx, done=done, begun=begun,
                    logits=logits, tokens=tokens) -> None:
            if not begun[step]:
                begun[step] = True
                mem.begin_step(step)
            plan = plans[step]
            _check_reads(plan, mem, tid, step)
            ctx.begin(tid, plan.accesses[tid], step, start + step)
            KINDS[program.tasks[tid].opcode].compute(ctx, program.tasks[tid])
            done[step] += 1
            if done[step] == len(program.tasks):
                logits[step] = mem.values["logits"].clone()
                tokens[step] = int(mem.values["tokens"][start + step + 1])

        def on_merge(m: int, step: int, mem=mem, ctx=ctx) -> None:
            plan = plans[step]
            actor = len(program.tasks) + m
            _check_reads(plan, mem, actor, step)
            ctx.begin(actor, plan.accesses[actor], step, start + step)
            merge = plan.merges[m]
            op = program.graph.op(merge.op)
            KINDS[op.opcode].merge_compute(ctx, op, merge.group)

        def choose(ready: set[int], rng=rng, speed=speed) -> int:
            pool = sorted(ready)
            return rng.choices(pool, weights=[speed[s] for s in pool])[0]

        machine.run(choose, on_task, on_merge)
        if machine.stuck():
            raise VerificationError("deadlock", machine.deadlock_report())
        if first is None:
            first = (logits, tokens)
            _compare(reference, logits, tokens, prompt, start)
        elif tokens != first[1] or not all(map(torch.equal, logits, first[0])):
            raise VerificationError("mismatch", f"interleaving {i} gives other logits or tokens "
                                    "than interleaving 0: the result depends on the order")
    return first


def _compare(reference: Interpreter, logits: list[torch.Tensor], tokens: list[int],
             prompt: torch.Tensor, start: int) -> None:
    token = int(prompt[-1])
    for s, (got, sampled) in enumerate(zip(logits, tokens, strict=True)):
        want = reference.run(torch.tensor([token]), torch.tensor([start + s]))["logits"][0]
        scale = float(want.abs().max())
        err = float((got - want).abs().max())
        if not err <= 1e-4 * scale + 1e-6:
            raise VerificationError("mismatch", f"step {s}: logits differ from the interpreter's "
                                    f"by {err:.3g} (largest logit {scale:.3g})")
        if sampled != int(got.argmax()):
            raise VerificationError("mismatch", f"step {s}: sampled token {sampled} is not the "
                                    f"argmax {int(got.argmax())} of the step's logits")
        token = sampled


# -- entry point ---------------------------------------------------------------------------

NUMERIC_MAX_WEIGHT_BYTES = 64 * 2**20


def verify(program: Program, mode: str = "auto", *, steps: int = 3, interleavings: int = 4,
           seed: int = 0, prompt_len: int = 37, pos: int | None = None) -> VerifyReport:
    """Verify `program`'s streams. `mode`: "numeric", "structural", or "auto" (numeric for
    tp = 1 models of at most 64 MB of weights). Structural mode checks one step at context
    position `pos` (default: the last one); numeric mode prefills `prompt_len` tokens (capped
    to fit the cache) and runs `steps` steps."""
    t0 = time.perf_counter()
    seq = program.graph.attrs["max_seq_len"]
    if mode == "auto":
        small = program.graph.weight_bytes() <= NUMERIC_MAX_WEIGHT_BYTES
        mode = "numeric" if small and program.tp == 1 else "structural"
    if mode == "structural":
        structural(program, Plan(program, seq - 1 if pos is None else pos))
        return VerifyReport(mode, len(program.tasks), 1, 1, time.perf_counter() - t0)
    if mode != "numeric":
        raise ValueError(f"unknown verification mode {mode!r} (numeric, structural, auto)")
    if program.tp != 1:
        raise ValueError("numeric verification runs tp = 1 programs; use mode='structural'")
    prompt_len = max(1, min(prompt_len, seq - steps))
    plan = Plan(program, prompt_len - 1)
    preflight(program, plan)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tensors are tiny: torch's thread pool costs ms per op here
    try:
        logits, tokens = numeric(program, lambda p: Plan(program, p), steps, interleavings,
                                 seed, prompt_len)
    finally:
        torch.set_num_threads(threads)
    structural(program, plan)
    return VerifyReport(mode, len(program.tasks), steps, interleavings,
                        time.perf_counter() - t0, logits, tokens)
