"""Synchronization: the counters tasks wait on and signal.

Decides, for every task, which counters it waits for and which it increments. Each fused op
owns one counter in global memory, incremented once per task per decode step (release), so
after step s it reads (s + 1) x tasks; a consumer task acquires it until it reaches that value.
Counters only grow, so nothing is reset between tokens (the epoch is the step number). A task
waits only on the producers of its inputs, and of those only on ones that are not ancestors of
another producer: release/acquire is cumulative, so seeing the later producer's signal implies
the earlier one's writes. The embedding of step s waits on the argmax of step s - 1 (lag 1),
which is what closes the token loop inside the kernel. A chunked attention op signals once per
KV group: its chunk tasks arrive on a per-group counter and the last to arrive merges the
group and signals.

A split-K FFN's output has two writers in a step: the op before it writes the start value,
then every FFN task adds onto it. The adds must come after the start value (the FFN op must
wait for that op, which it does because it reads the op's x.attn: checked here) and every
reader after all adds (a reader waits for the FFN op, the output's last writer, whose counter
counts every task).
"""

from __future__ import annotations

import networkx as nx

from tilertc.passes.program import Counter, Program, ScheduleError

MAX_WAITS = 2


def synchronize(program: Program) -> Program:
    g = program.graph
    ops = g.ops()
    index = {op.name: i for i, op in enumerate(ops)}
    ntasks = {op.name: op.attrs["tile"].get("signals", op.attrs["tile"]["tasks"]) for op in ops}
    program.counters = [Counter(op.name, ntasks[op.name]) for op in ops]
    arrive_base = {}
    for op in ops:  # chunked attention: one arrival counter per KV group (see tiling)
        if "chunks" in op.attrs["tile"]:
            arrive_base[op.name] = len(program.counters)
            program.counters += [Counter(f"{op.name}.arrivals[{g}]", op.attrs["tile"]["chunks"])
                                 for g in range(op.attrs["tile"]["signals"])]
    ancestors = {op.name: nx.ancestors(g.nx, op.name) for op in ops}
    waits_of: dict[str, list[tuple[int, int, int]]] = {}
    for op in ops:
        producers = set(g.nx.predecessors(op.name))
        needed = [p for p in producers if not any(p in ancestors[q] for q in producers if q != p)]
        waits = [(index[p], ntasks[p], 0) for p in sorted(needed, key=index.get)]
        if op.opcode == "embed":
            sampler = next(o for o in ops if o.opcode == "argmax")
            waits.append((index[sampler.name], 1, 1))
        if len(waits) > MAX_WAITS:
            raise ValueError(f"op {op.name!r} needs {len(waits)} waits (max {MAX_WAITS})")
        waits_of[op.name] = waits
        op.attrs["waits"] = [f"{ops[c].name}{' (previous step)' if lag else ''}"
                             for c, _, lag in waits]
    for op in ops:
        start = next((p for p in g.producers(op.name)
                      if p.attrs.get("start_value") in op.outputs), None)
        if op.attrs.get("accumulate") and (start is None or not any(
                start.name == ops[c].name or start.name in ancestors[ops[c].name]
                for c, _, _ in waits_of[op.name])):
            raise ScheduleError(f"op {op.name!r} adds into {op.outputs[0]!r} without waiting "
                                "for the op that writes its start value")
    for t in program.tasks:
        t.waits = [(c, per, lag) for c, per, lag in waits_of[t.op]]
        t.signal = index[t.op]
        if t.op in arrive_base:
            t.arrive = arrive_base[t.op] + t.rows[0]
    program.decide("synchronization", f"{len(program.counters)} counters (one per fused op), "
                   "monotonic across steps; waits pruned to non-implied producers")
    return program
