"""Where one op's task time goes, phase by phase, on the GPU:

    python tools/phase_probe.py build ARTIFACT OUT --mark TEXT [--mark TEXT ...] [--warp W]
    python tools/phase_probe.py run OUT --op OP [--op OP ...] [--step S] [--context N]  # on a GPU

`build` (here: nvcc) makes a variant of ARTIFACT (tools/kernel_variant.py) in which lane 0 of
compute warp W (0 unless --warp), on reaching the line of kernel.cu that holds each --mark's
TEXT (unique in the file; the line must begin a statement where the launch's `Params& p` is in
scope), writes the mark's number and the globaltimer into the profile buffer past the profiled
steps, the first MARKS of each CTA's launch (counted from run_compute's start, so a mark goes
in code the compute warps run after it: a task's). `run` loads the variant with random weights,
decodes a few steps with the stamps on and prints, for the tasks of OP (layers folded, e.g.
`attention`) in one step, the mean time per task from its dependencies met to its first mark,
between consecutive marks (a mark in a loop counts each time round), and from its last mark to
its end. The stamps are that one warp's view (a line it never reaches stamps nothing): where a
phase ends in a barrier, mark the line after it; to see whether a phase is one slow warp or
all, build one variant a warp and run each (the task's start and end stay the CTA's).

MLA attention, for instance:

    python tools/phase_probe.py build ART OUT \\
        --mark '  mla_stage_queries(p, t, stage,' --mark '  float acc[MLA_OT][4] = {};' \\
        --mark '    mla_scores(m, rows, warp, lane);' --mark '    mla_softmax(m, static_cast' \\
        --mark '    mla_values(m, rows, o, warp, lane);' --mark '  mla_write_part(p.act'

A matrix-vector task's staging and pages (an FP8 tile task; `--op o_proj` etc.; the staging
round's mark counts once per round; docs/performance.md, session 24):

    python tools/phase_probe.py build ART OUT \
        --mark '  const float res = add && ct < rows ? residual(' \
        --mark '    const int E = block_exponent(m);' \
        --mark '  matvec_pages(p, s, t, rows, rb, rpp, k8, halves, consumed, lane, group, gw);' \
        --mark '  const float rstd = normed(t) ? s.red[COMPUTE_WARPS] : 1.f;'
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
from kernel_variant import make_variant, summary
from stream_probe import STEPS, add_run_options, random_engine, spare_words, stamped_profile

from tilertc.profile import DEPS_MET, DONE

MARKS = 4096  # marks kept per CTA
MARKS_FILE = "phase_marks.json"


def mark_function(warp: int) -> str:
    """`phase_mark(p, id)`: lane 0 of compute warp `warp` writes (id, globaltimer) in CTA
    blockIdx.x's next slot past the steps. Its count of marks is the kernel's shared flag
    word kept for the probes (FLAG_PROBE), set to 0 at the launch's start (RESET): a count in
    global memory was loaded again at each mark, an L2 round trip that held the marking warp,
    and so every barrier it reaches, in every mark; a static shared word of its own left no room
    in kernels whose ring fills shared memory (GLM-5's one-layer models)."""
    return f"""__device__ __forceinline__ volatile int& phase_count() {{  // the CTA's marks so far
  extern __shared__ __align__(128) uint8_t phase_smem[];
  return carve(phase_smem).flags[FLAG_PROBE];
}}
__device__ __forceinline__ void phase_mark(const Params& p, int id) {{
  if (!p.profile || threadIdx.x != {32 * warp}) return;
  const int n = phase_count();
  if (n >= {MARKS}) return;
  phase_count() = n + 1;
  unsigned long long* at = {spare_words(str(2 * MARKS), "2 * n")};
  at[0] = id;
  at[1] = now_ns();
}}
"""


BEFORE = "// ---- the loader warp"  # after now_ns, Params and carve
RESET = "  uint32_t consumed = 0;\n"  # run_compute's start: the marking thread zeroes its count


def marked_source(source: str, marks: list[str], warp: int = 0) -> str:
    """kernel.cu with `phase_mark(p, i)` at the start of the line holding marks[i], and the
    function (compute warp `warp` stamping) ahead of every use (before the loader). Refuses a
    mark not once in the source."""
    for i, text in enumerate(marks):
        if source.count(text) != 1:
            raise SystemExit(f"--mark {text!r} is in the kernel {source.count(text)} times, "
                             "not once")
        line = source.rfind("\n", 0, source.index(text)) + 1
        source = f"{source[:line]}  phase_mark(p, {i});\n{source[line:]}"
    if source.count(RESET) != 1:
        raise SystemExit(f"the kernel has {source.count(RESET)} lines {RESET.strip()!r}, not one: "
                         "nowhere to zero the marks' count")
    zero = f"  if (threadIdx.x == {32 * warp}) phase_count() = 0;\n"
    source = source.replace(RESET, RESET + zero)
    return source.replace(BEFORE, mark_function(warp) + BEFORE, 1)


def build(artifact: Path, out: Path, marks: list[str], warp: int = 0) -> dict:
    """The marked variant of `artifact` in `out` (and its marks in MARKS_FILE); ptxas's report.
    Refuses a warp the kernel does not have."""
    source = (artifact / "kernel.cu").read_text()
    warps = json.loads((artifact / "manifest.json").read_text())["kernel"]["constants"][
        "COMPUTE_WARPS"]
    if not 0 <= warp < warps:
        raise SystemExit(f"--warp {warp}: the kernel has compute warps 0-{warps - 1}")
    report = make_variant(artifact, out, [], [[source, marked_source(source, marks, warp)]])
    (out / MARKS_FILE).write_text(json.dumps(marks, indent=1))
    return report


def phases(stamps: np.ndarray, log: np.ndarray, ops: list[str], ctas: np.ndarray, op: str,
           labels: list[str]) -> tuple[int, dict[str, float], dict[str, float]]:
    """For the tasks of `op` in one step (`stamps`: [tasks, 3] ns), their marks from `log`
    ([ctas, MARKS, 2]: id, ns; zero where unwritten) inside each task's time: the tasks seen,
    and per transition ("deps met -> a", "a -> b", "b -> done") its mean µs per task and the
    mean times it came per task."""
    total: dict[str, float] = defaultdict(float)
    times: dict[str, int] = defaultdict(int)
    tasks = 0
    for task in (i for i, o in enumerate(ops) if o == op):
        met, done = int(stamps[task, DEPS_MET]), int(stamps[task, DONE])
        if not done:  # the task did not run
            continue
        cta = log[ctas[task]].astype(np.int64)
        mine = cta[(cta[:, 1] >= met) & (cta[:, 1] <= done)]
        tasks += 1
        prev, at = "deps met", met
        for mark, ns in sorted(mine.tolist(), key=lambda m: m[1]):
            key = f"{prev} -> {labels[mark]}"
            total[key] += (ns - at) / 1e3
            times[key] += 1
            prev, at = labels[mark], ns
        total[f"{prev} -> done"] += (done - at) / 1e3
        times[f"{prev} -> done"] += 1
    return (tasks, {k: v / max(tasks, 1) for k, v in total.items()},
            {k: v / max(tasks, 1) for k, v in times.items()})


def run(artifact: Path, ops_asked: list[str], step: int, context: int) -> None:
    """One stamped decode of `artifact`; each asked op's phases from it."""
    from tilertc.profile import fold_layer

    labels = [m.strip() for m in json.loads((artifact / MARKS_FILE).read_text())]
    profile, words = stamped_profile(random_engine(artifact), MARKS * 2, context)
    log = words.reshape(words.shape[0], MARKS, 2)
    ops = [fold_layer(o) for o in profile.ops]
    for op in ops_asked:
        tasks, mean_us, count = phases(profile.stamps[step], log, ops, profile.ctas, op, labels)
        print(f"== {artifact}: {op}, {tasks} tasks of step {step} of {STEPS}, context {context};"
              " µs a task")
        for key, us in mean_us.items():
            print(f"  {us:8.2f}  x{count[key]:<5.2f} {key}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="a marked variant of ARTIFACT in OUT (needs nvcc)")
    b.add_argument("artifact", type=Path)
    b.add_argument("out", type=Path)
    b.add_argument("--mark", action="append", required=True, metavar="TEXT",
                   help="stamp at the line holding TEXT (repeatable; in order)")
    b.add_argument("--warp", type=int, default=0,
                   help="the compute warp whose lane 0 stamps [default: 0]")
    r = sub.add_parser("run", help="decode with the marks on and print OP's phases (needs a GPU)")
    r.add_argument("artifact", type=Path)
    r.add_argument("--op", action="append", required=True,
                   help="an op, layers folded (e.g. attention); repeatable, one decode for all")
    add_run_options(r)
    args = parser.parse_args(argv)
    if args.command == "build":
        print(summary(args.out, build(args.artifact, args.out, args.mark, args.warp)))
    else:
        run(args.artifact, args.op, args.step, args.context)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
