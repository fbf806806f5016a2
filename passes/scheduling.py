"""Scheduling: place every task on an SM and order each SM's instruction stream.

Decides the per-SM streams by list scheduling in program order over the cost model's time:
an op is ready when the last of its producers' tasks is done, and its tasks go, largest first,
each to the SM where it would finish first (an SM still busy with an earlier op starts it
late); among SMs that would finish together, to the one least loaded so far, so a small op
(attention's few KV groups, embed, argmax) lands on SMs that had less to do in earlier ops.
So an op beside another one (the DSA indexer beside MLA's q absorption: tiling's
`sms_beside`) runs on the SMs the other leaves instead of queueing behind it. Each SM runs
its tasks in program order; since a task only ever waits on ops earlier in that order, and
all CTAs are resident, no wait can be part of a cycle.
"""

from __future__ import annotations

import heapq

from tilertc.passes.cost import task_ns
from tilertc.passes.program import Program


def schedule(program: Program) -> Program:
    g, n = program.graph, program.target.num_sms
    load = [0.0] * n  # cost-model time each SM has streamed so far
    free = [0.0] * n  # when each SM is done with what it was given so far
    done: dict[str, float] = {}  # when each op's last task is done
    program.streams = [[] for _ in range(n)]
    by_op: dict[str, list[int]] = {}
    for i, t in enumerate(program.tasks):
        t.est_ns = task_ns(program, t)
        by_op.setdefault(t.op, []).append(i)
    for op in g.ops():
        ready = max((done[p] for p in g.nx.predecessors(op.name) if p in done), default=0.0)
        # an SM's place: when it could start a task of this op, then its load so far
        heap = [(max(free[s], ready), load[s], s) for s in range(n)]
        heapq.heapify(heap)
        for i in sorted(by_op[op.name], key=lambda i: -program.tasks[i].est_ns):
            task = program.tasks[i]
            start, _, task.sm = heapq.heappop(heap)
            free[task.sm] = start + task.est_ns
            load[task.sm] += task.est_ns
            heapq.heappush(heap, (free[task.sm], load[task.sm], task.sm))
        done[op.name] = max(free[program.tasks[i].sm] for i in by_op[op.name])
        for i in sorted(by_op[op.name]):
            program.streams[program.tasks[i].sm].append(i)
    busiest = max(load)
    program.decide("scheduling", f"{len(program.tasks)} tasks on {n} SMs; per-SM streamed time "
                   f"{min(load) / 1e3:.1f}-{busiest / 1e3:.1f} us (imbalance "
                   f"{(busiest / (sum(load) / n) - 1) * 100 if sum(load) else 0:.1f}%)")
    return program
