"""Role specialization: what each warp of a CTA does, and what each CTA does.

Decides the warp roles: one loader warp walks its SM's instruction stream ahead of compute and
keeps the weight ring full (one elected lane issues the bulk copies); the compute warps do the
math and, at the end of each task, one thread publishes the task's counter (store-signal).
Compute gets enough warps that its arithmetic rate sits well above the SM's share of HBM
bandwidth, so that it catches up after every dependency stall (DESIGN.md: 8 warps could not,
16-24 could); the cap comes from the register file. The compute warps may be split into page
groups that take ring pages in turn: a page's work is short and latency-bound (wait, a few
loads, reductions, release), so several pages may be in progress at once. Each group owns
every G-th ring slot (the ring is a multiple of the group count), so that no group can run a
full ring ahead of the pages it waits for.
All CTAs have the same role (one per SM); with tensor parallelism each rank runs the same
program on its shard.
"""

from __future__ import annotations

from tilertc.passes.program import Program, ScheduleError

COMPUTE_WARPS = 16
PAGE_GROUPS = 1  # >1 measured no faster on llama-3.2-1b yet (docs/performance.md)
REGS_PER_THREAD = 64  # the fewest the kernel is built to fit in


def compute_warps(program: Program) -> int:
    """The compute warps a CTA gets: the `compute_warps` knob, else COMPUTE_WARPS (passes
    before this one, such as place, size per-warp state by it)."""
    return program.config.get("tuning", {}).get("compute_warps", COMPUTE_WARPS)


def register_cap(regs_per_sm: int, threads: int) -> int:
    """The registers ptxas allows each thread of a one-CTA-per-SM kernel of `threads`: the
    register file over the threads rounded up to a multiple of 128, in steps of 8 (as builds
    that spill show: qwen3-32b FP8 at 544 threads used 96, at 672 80, at 800 72)."""
    return regs_per_sm // (-(-threads // 128) * 128) // 8 * 8


def assign_roles(program: Program) -> Program:
    warps = compute_warps(program)
    threads = (warps + 1) * 32
    if threads * REGS_PER_THREAD > program.target.regs_per_sm:
        raise ScheduleError(
            f"{warps} compute warps at {REGS_PER_THREAD} registers exceed "
            f"the register file of {program.target.name}"
        )
    pages = program.config["ring_pages"]
    groups = program.config["tuning"].get("page_groups", PAGE_GROUPS)
    if warps % groups or pages % groups or groups >= pages:
        raise ScheduleError(
            f"{groups} page groups must divide the {warps} compute warps and the "
            f"{pages} ring pages, and leave pages in flight"
        )
    program.config.update(
        compute_warps=warps, threads=threads, ctas=program.target.num_sms, page_groups=groups
    )
    program.decide(
        "roles",
        f"per CTA: 1 loader warp + {warps} compute warps "
        f"({threads} threads; the register file leaves each up to "
        f"{register_cap(program.target.regs_per_sm, threads)} registers); one CTA per SM",
    )
    if groups == 1:
        program.decide("roles", f"all compute warps work on one ring page at a time ({pages} "
                       f"pages: {pages - 1} in flight while one is computed)")
    else:
        program.decide("roles", f"compute warps in {groups} groups of {warps // groups}, each on "
                       f"its own ring page, so that page latencies overlap ({pages} pages: "
                       f"{pages - groups} stay in flight while every group computes)")
    return program
