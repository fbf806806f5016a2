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
group and signals. A DSA attention's wait for its indexer's selection is marked
(`selection_wait`): the kernel skips it while the selection is every token (`waits_at`).

Under tensor parallelism (tp > 1) each rank runs the same streams on its shard, and ranks meet
only in exchanges, which are waits on counters too. Decided here: an all-reduce is done inside
the tasks of the op that produces the partial sum (`sharding.exchange_ops`: the fused
o_proj / down projection + residual add), not in a separate op or in the consumers. Task i of
such an op computes its partial rows, writes them into its rank's slot of the op's receive
buffer on every rank (through NVLink), and arrives (release, system scope) on the exchange
counter `op.exchange[i]` of every rank; it then waits (acquire, system scope) until its own
copy of that counter reaches tp x (step + 1), sums the tp partial rows in rank order, adds
the residual and writes its output rows as at tp 1, then signals the op's counter as usual.
So consumers wait on local counters exactly as at tp 1, every rank computes bit-identical sums
(same operands, same order), and the exchange adds no op boundary. Why it cannot deadlock: a
task waits only for the same task on the other ranks, whose streams are identical, so what
precedes that task's publish on another rank is what precedes it here (the verifier runs the
ranks' streams together to check it). The sampler exchanges each rank's best (logit, row)
pair and its view of the host's stop flag the same way (`sample.exchange`), so that every rank
picks the same token and stops at the same step. The receive buffers are reused every step:
a rank writes step s + 1's rows only after the sampler exchange of step s, which every rank
enters after all its tasks of step s, so no rank still reads step s's rows.

A split-K FFN's output has two writers in a step: the op before it writes the start value,
then every FFN task adds onto it. The adds must come after the start value (the FFN op must
wait for that op, which it does because it reads the op's x.attn: checked here) and every
reader after all adds (a reader waits for the FFN op, the output's last writer, whose counter
counts every task).
"""

from __future__ import annotations

import networkx as nx

from tilertc.passes.program import Counter, Program, ScheduleError
from tilertc.passes.sharding import exchange_ops

MAX_WAITS = 2


def synchronize(program: Program) -> Program:
    g = program.graph
    ops = g.ops()
    index = {op.name: i for i, op in enumerate(ops)}
    ntasks = {op.name: op.attrs["tile"].get("signals", op.attrs["tile"]["tasks"]) for op in ops}
    program.counters = [Counter(op.name, ntasks[op.name]) for op in ops]
    arrive_base = {}
    for op in ops:  # chunked attention: one arrival counter per KV group (see tiling)
        if op.attrs["tile"].get("merge") == "last chunk":
            arrive_base[op.name] = len(program.counters)
            program.counters += [Counter(f"{op.name}.arrivals[{g}]", op.attrs["tile"]["chunks"])
                                 for g in range(op.attrs["tile"]["signals"])]
    exchange_base = _exchange_counters(program)
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
        if op.opcode == "mla_attention":
            _mark_selection_wait(op, [ops[c] for c, _, _ in waits], producers, ancestors)
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
        if t.op in exchange_base:
            t.exchange = exchange_base[t.op] + t.index
    program.decide("synchronization", f"{len(program.counters)} counters (one per fused op), "
                   "monotonic across steps; waits pruned to non-implied producers")
    marked = [op.name for op in ops if "selection_wait" in op.attrs]
    if marked:
        program.decide("synchronization", f"{len(marked)} DSA attention ops take no wait for "
                       "their indexer's top-k while the context is at most index_topk tokens "
                       "(every token is selected, in order)")
    if exchange_base:
        program.decide("synchronization", f"tp {program.tp}: {len(exchange_base) - 1} "
                       "all-reduces inside their ops' tasks (each task's partial rows to every "
                       "rank, one exchange counter per task) and the sampler's exchange of "
                       "(max, row) pairs; sums in rank order, identical on every rank")
    return program


def _mark_selection_wait(op, waited: list, producers: set[str],
                         ancestors: dict[str, set[str]]) -> None:
    """Marks which of a DSA attention's waits (`op.attrs["selection_wait"]`) is for the indexer's
    top-k: while the context is at most index_topk tokens the selection is every token in order,
    so the kernel computes the chunk's row ids instead of reading the list and skips that wait
    (decode/dependencies.cuh), and attention waits only for its queries. Marked only where the
    other waits still imply every other producer (each is waited for or an ancestor of one that
    is), so that skipping the wait leaves no other read unordered."""
    selection = [i for i, w in enumerate(waited) if w.opcode == "dsa_topk"]
    if not selection:
        return
    rest = {w.name for i, w in enumerate(waited) if i != selection[0]}
    others = producers - {waited[selection[0]].name}
    if all(p in rest or any(p in ancestors[r] for r in rest) for p in others):
        op.attrs["selection_wait"] = selection[0]


def selects_every_token(program: Program, op, pos: int) -> bool:
    """Whether a DSA attention's selection at context position `pos` is every token in order
    (pos + 1 <= index_topk), where its kernel reads no list and skips the selection wait."""
    return bool(op.attrs.get("dsa")) and pos + 1 <= program.graph.tensors[op.inputs[3]].numel


def waits_at(program: Program, task, pos: int) -> list[tuple[int, int, int]]:
    """The waits a task's kernel code takes at context position `pos`: its waits, less a DSA
    attention's selection wait while the selection is every token (decode/dependencies.cuh:
    wait_deps). The verifier runs the streams with these."""
    op = program.graph.op(task.op)
    skip = op.attrs.get("selection_wait", -1) if selects_every_token(program, op, pos) else -1
    return [w for i, w in enumerate(task.waits) if i != skip]


def _exchange_counters(program: Program) -> dict[str, int]:
    """Under tp > 1, one exchange counter per task of each all-reducing op and one for the
    sampler, appended to `program.counters` (each reaches tp per step: one arrival per rank);
    returns each op's first one."""
    if program.tp == 1:
        return {}
    base = {}
    sampler = next(op for op in program.graph.ops() if op.opcode == "argmax")
    for op in [*exchange_ops(program), sampler]:
        base[op.name] = len(program.counters)
        n = op.attrs["tile"]["tasks"]
        program.counters += [Counter(f"{op.name}.exchange[{i}]" if n > 1 else f"{op.name}.exchange",
                                     program.tp) for i in range(n)]
    return base
