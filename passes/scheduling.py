"""Scheduling: place every task on an SM and order each SM's instruction stream.

Decides the per-SM streams by list scheduling in op order: the tasks of an op go, largest
first, to the SM that is least loaded so far (cost model time), so a small op (attention's
few KV groups, embed, argmax) lands on SMs that had less to do in earlier ops. Each SM runs
its tasks in global op order; since a task only ever waits on ops earlier in that order, and
all CTAs are resident, no wait can be part of a cycle.
"""

from __future__ import annotations

import heapq

from tilertc.passes.cost import task_ns
from tilertc.passes.program import Program


def schedule(program: Program) -> Program:
    n = program.target.num_sms
    load = [0.0] * n
    program.streams = [[] for _ in range(n)]
    by_op: dict[str, list[int]] = {}
    for i, t in enumerate(program.tasks):
        t.est_ns = task_ns(program, t)
        by_op.setdefault(t.op, []).append(i)
    for op in program.graph.ops():
        ids = sorted(by_op[op.name], key=lambda i: -program.tasks[i].est_ns)
        free = sorted(range(n), key=lambda s: (load[s], s))
        if len(ids) <= n:
            for sm, i in zip(free, ids, strict=False):
                program.tasks[i].sm = sm
                load[sm] += program.tasks[i].est_ns
        else:  # more tasks than SMs: each to the least loaded SM so far
            heap = [(load[s], s) for s in free]
            for i in ids:
                _, sm = heapq.heappop(heap)
                program.tasks[i].sm = sm
                load[sm] += program.tasks[i].est_ns
                heapq.heappush(heap, (load[sm], sm))
        for i in sorted(by_op[op.name]):
            program.streams[program.tasks[i].sm].append(i)
    busiest = max(load)
    program.decide("scheduling", f"{len(program.tasks)} tasks on {n} SMs; per-SM streamed time "
                   f"{min(load) / 1e3:.1f}-{busiest / 1e3:.1f} us (imbalance "
                   f"{(busiest / (sum(load) / n) - 1) * 100 if sum(load) else 0:.1f}%)")
    return program
