"""L2 prefetch: which tasks ask L2 for their weight pages before the ring can take them.

An SM's ring holds two pages (passes/residency.py), so the loader runs at most two pages ahead
of compute. Where compute waits on a chain of small, latency-bound ops, HBM idles: in an MLA
layer the q absorption, the DSA indexer, attention and the v expansion stream ~17 MB in ~40 µs
on an H200 (DeepSeek-V3.2, docs/performance.md, session 43), and the loader, which issued
o_proj's first page early in that chain, then waits for a free slot. o_proj streams 100-118 MB
after it, HBM-bound. So the loader, on reaching an o_proj task, asks L2
(`cp.async.bulk.prefetch.L2`) for the task's next `l2_pages` pages, which then arrive from L2
when their slots free up instead of from HBM while o_proj runs (decode.cuh: run_loader).

Decides, where the `l2_prefetch_pages` knob asks (N > 0; off by default until measured on the
GPU: session 27's prefetches into L2, issued on every page of a steadily streaming kernel, made
llama-3.1-8b FP8 slower): for each MLA layer's o_proj (the `matvec_add` that reads the v
expansion), that its tasks prefetch their pages 1..N (page 0 goes to the ring at once), as many
as keep the op's prefetched bytes within half of L2 (the rest of it holds the activations, the
latent cache rows attention reads and the chain's own streams, which pass through it
evict-first). The op's `l2_pages` attr; encode.py writes it as the tasks' `l2_pages` field.
"""

from __future__ import annotations

from tilertc.passes.program import Program, ScheduleError

L2_SHARE = 2  # the prefetched pages of one op take at most 1 / L2_SHARE of L2


def _after_v_expansion(program: Program, op) -> bool:
    """Whether `op` is an MLA layer's o_proj: a matvec_add of the v expansion's output."""
    g = program.graph
    return op.opcode == "matvec_add" and any(
        src.opcode == "head_matvec" and "merges" in src.attrs for src in g.producers(op.name))


def l2_prefetch(program: Program) -> Program:
    asked = program.config["tuning"].get("l2_prefetch_pages") or 0
    if asked < 0:
        raise ScheduleError(f"l2_prefetch_pages={asked}: a page count, at least 0")
    if not asked:
        return program
    ops = [op for op in program.graph.ops() if _after_v_expansion(program, op)]
    if not ops:
        raise ScheduleError("l2_prefetch_pages prefetches MLA o_proj's pages into L2, but "
                            f"{program.spec.name} has no MLA attention")
    page = program.config["page_bytes"]
    tasks = len(program.tasks_of(ops[0].name))
    pages = min(asked, program.target.l2_bytes // L2_SHARE // (tasks * page))
    if pages < 1:
        program.decide("prefetch", f"none: a page of each of o_proj's {tasks} tasks is past "
                       f"1/{L2_SHARE} of L2")
        return program
    for op in ops:
        op.attrs["l2_pages"] = pages
    program.decide("prefetch", f"{len(ops)} MLA o_proj ops: each task asks L2 for its pages "
                   f"1-{pages} when the loader reaches it ({pages * tasks * page / 1e6:.1f} MB an "
                   f"op, of {program.target.l2_bytes / 2**20:.0f} MiB of L2)"
                   + (f"; {asked} asked, capped at 1/{L2_SHARE} of L2" if pages < asked else ""))
    return program
