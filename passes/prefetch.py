"""L2 prefetch: which tasks ask L2 for their weight pages before the ring can take them.

An SM's ring holds two pages (passes/residency.py), so the loader runs at most two pages ahead
of compute, and where compute is latency-bound HBM idles. An MLA layer has two such stretches
before a large projection (DeepSeek-V3.2 MoE layer on an H200, docs/performance.md, sessions
41-43):
- the input projection (16 MB, ~10 µs a task: its staging and norm), then q_b_proj (~50 MB in
  ~18 µs, 2.8 TB/s);
- the q absorption, the DSA indexer, attention and the v expansion (~17 MB in ~40 µs), then
  o_proj (100-118 MB, HBM-bound, ~36 µs).
The loader reaches the projection's task early in the stretch (it needs no input to load
weights), takes its first page into the ring and then waits for a free slot. So there it asks
L2 (`cp.async.bulk.prefetch.L2`) for the task's next `l2_pages` pages, which then come from L2
when their slots free up instead of from HBM while the projection runs (decode.cuh:
run_loader, prefetch_pages).

Decides, where the `l2_prefetch_pages` knob asks (N > 0; off by default until measured on the
GPU: session 27's prefetches into L2, issued on every page of a steadily streaming kernel, made
llama-3.1-8b FP8 slower): that each MLA layer's q_b_proj (the norm_matvec of the q LoRA's second
half, which the q absorption reads) and o_proj (the matvec_add of the v expansion's output)
tasks prefetch their pages 1..N (page 0 goes to the ring at once), as many as keep an op's
prefetched bytes within half of L2 (the rest of it holds the activations, the latent cache rows
attention reads and the stretch's own streams, which pass through it evict-first). The op's
`l2_pages` attr; encode.py writes it as the tasks' `l2_pages` field.
"""

from __future__ import annotations

from tilertc.passes.program import Program, ScheduleError
from tilertc.passes.tiling import is_v_expansion

L2_SHARE = 2  # the prefetched pages of one op take at most 1 / L2_SHARE of L2


def _after_latency_bound(program: Program, op) -> bool:
    """Whether `op` is an MLA layer's q_b_proj (a norm_matvec of the input projection's output,
    read by the q absorption) or o_proj (a matvec_add of the v expansion's output)."""
    g = program.graph
    if op.opcode == "matvec_add":
        return any(is_v_expansion(src) for src in g.producers(op.name))
    return (op.opcode == "norm_matvec"
            and any(src.opcode == "norm_matvec" for src in g.producers(op.name))
            and any(dst.opcode == "head_matvec" and dst.attrs["io"]["x"][0] == op.name
                    for dst in g.consumers(op.name)))


def l2_prefetch(program: Program) -> Program:
    asked = program.config["tuning"].get("l2_prefetch_pages") or 0
    if asked < 0:
        raise ScheduleError(f"l2_prefetch_pages={asked}: a page count, at least 0")
    if not asked:
        return program
    ops = [op for op in program.graph.ops() if _after_latency_bound(program, op)]
    if not ops:
        raise ScheduleError("l2_prefetch_pages prefetches MLA q_b_proj's and o_proj's pages into "
                            f"L2, but {program.spec.name} has no MLA attention")
    page, share = program.config["page_bytes"], program.target.l2_bytes // L2_SHARE
    chosen = {}
    for op in ops:
        tasks = len(program.tasks_of(op.name))
        pages = min(asked, share // (tasks * page))
        if pages > 0:
            op.attrs["l2_pages"] = pages
            chosen[op.name.split(".")[-1]] = (pages, pages * tasks * page)
    what = "; ".join(f"{name}: each task asks L2 for its pages 1-{n} when the loader reaches it "
                     f"({b / 1e6:.1f} MB an op)" for name, (n, b) in sorted(chosen.items()))
    program.decide("prefetch", f"{what or 'none: a page of every task is past the share'} "
                   f"({len(ops)} MLA ops; {asked} pages asked, at most 1/{L2_SHARE} of L2's "
                   f"{program.target.l2_bytes / 2**20:.0f} MiB an op)")
    return program
