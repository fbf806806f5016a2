"""Where a matrix-vector task's time goes, page by page, on the GPU:

    python tools/stream_probe.py build ARTIFACT OUT [--pages N]   # here (nvcc, no GPU)
    python tools/stream_probe.py run OUT [OUT ...] [--step S] [--context N]  # on a GPU

`build` makes a variant of ARTIFACT (tools/kernel_variant.py) whose kernel, while profiling,
also stamps each page (globaltimer): when the loader issued it, when compute began to wait for
it, saw it and was done with it (compute thread 0; an FP8 tile page's slot is released a little
earlier, before its last folds), for the first N pages of a launch per SM; and
it stamps the end of each matrix-vector task's input staging in place of the task's start.
The page stamps go into the profile buffer past the profiled steps, which `run` makes large
enough. `run` loads each variant with random weights (one set per model), decodes a few
steps with the stamps on and prints per op, its layers folded: the staging (dependencies met
to input staged), pages per task, page compute (seen to released), how long a task waited for
pages not yet there, a page's issue-to-seen time, and how long before the task's dependencies
were met its first page was issued (negative: after; with the staging and a page's flight it
says whether the first page arrives before compute wants it). docs/performance.md's session 18
tables were measured this way. The stamps are timing aids: a few global stores a page.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from kernel_variant import make_variant, summary

# a task's stamps; in a probe variant a matrix-vector task's START is where its staging ended
from tilertc.profile import DEPS_MET, DONE, START

STEPS = 4  # decode steps of the stamped launch (the page stamps lie past them)
ISSUED, WAITING, SEEN, RELEASED = range(4)  # a page's stamps


def spare_words(per_cta: str, index: str) -> str:
    """kernel.cu's address of word `index` of this CTA's `per_cta` stamp words past the
    profiled steps (`stamped_profile` reads them back as [ctas, per_cta])."""
    return (f"(p.profile + {STEPS} * p.n_tasks * 3"
            f" + blockIdx.x * static_cast<long long>({per_cta}) + {index})")


def page_stamps(index: str) -> str:
    """The 4 stamps of page `index` of this CTA's launch, past the profiled steps."""
    return spare_words("PROBE_PAGES * 4", f"({index}) * 4")


# the end of a task's staging, stamped in place of its start. Where the task's stamps lie (their
# offset into p.profile, -1 when not profiled) is the kernel's shared flag word kept for the
# probes: read from global memory after thread 0's own store, it cost thread 0 an L2 round trip
# before the stamp of each staging's end, and a static shared word of its own left no room in
# kernels whose ring fills shared memory (GLM-5's one-layer models).
STAMP_AT = "s.flags[FLAG_PROBE]"
STAGED = (f"    if (ct == 0) {{ const int at = {STAMP_AT}; "
          "if (at >= 0) p.profile[at] = now_ns(); }\n")
# (old, new) edits of the device library's text in kernel.cu; PROBE_PAGES is the variant's #define
LOADER_ISSUE = "        uint8_t* page = start_page(p, s, issued, bytes, full);\n" \
               "        if (!page) goto drain;\n"
EDITS = [
    (LOADER_ISSUE,
     LOADER_ISSUE + "        if (p.profile && issued - 1 < PROBE_PAGES)\n"
     f"          {page_stamps('(issued - 1)')}[0] = now_ns();\n"),
    ("    ring_wait(p, &s.full[slot], (page_index / RING_PAGES) & 1, nullptr);\n",
     "    unsigned long long* probe = p.profile && threadIdx.x == 0 && page_index < PROBE_PAGES\n"
     f"        ? {page_stamps('page_index')} : nullptr;\n"
     "    if (probe) probe[1] = now_ns();\n"
     "    ring_wait(p, &s.full[slot], (page_index / RING_PAGES) & 1, nullptr);\n"
     "    if (probe) probe[2] = now_ns();\n"),
    # released: after the body, which releases an FP8 tile page itself before its last folds
    ("      release_page(s, slot);\n    }\n  }\n  consumed = page_index;\n",
     "      release_page(s, slot);\n    }\n    if (probe) probe[3] = now_ns();\n  }\n"
     "  consumed = page_index;\n"),
    ("      if (stamp) stamp[1] = now_ns();\n",
     "      if (stamp) stamp[1] = now_ns();\n"
     f"      if (ct == 0) {STAMP_AT} = stamp ? static_cast<int>(stamp - p.profile) : -1;\n"),
    ("    stage_vector(p, s, t, ct);\n    matvec_pages(",
     "    stage_vector(p, s, t, ct);\n" + STAGED + "    matvec_pages("),
    # an FP8 tile task: its input staged (digits converted or copied in)
    ("    stage_digits(p, s, t, ct);\n  if (tile_segments(",
     "    stage_digits(p, s, t, ct);\n" + STAGED + "  if (tile_segments("),
]


def build(artifact: Path, out: Path, pages: int) -> dict:
    """The instrumented variant of `artifact` in `out`; ptxas's resource report."""
    return make_variant(artifact, out, [f"PROBE_PAGES={pages}"], [list(e) for e in EDITS])


def probe_pages(artifact: Path) -> int:
    """The pages per SM a `build` variant stamps; refuses an artifact that is not one."""
    for line in (artifact / "kernel.cu").read_text().splitlines():
        if line.startswith("#define PROBE_PAGES "):
            return int(line.split()[2])
    raise SystemExit(f"{artifact} is not a stream probe variant: make one with "
                     f"`python tools/stream_probe.py build ARTIFACT OUT`")


@dataclass(frozen=True)
class OpStream:
    """One op's tasks (layers folded) of one step: means per task, or per page, in µs."""

    op: str
    tasks: int
    staging_us: float  # dependencies met to input staged
    pages: float  # per task
    page_compute_us: float  # a page seen to released (compute thread 0)
    first_page_us: float  # the same for a task's first page only (its code may be cold)
    stall_us: float  # per task: waiting for pages not yet there
    flight_us: float  # a page issued to seen, for pages issued during the task (nan: none)
    lead_us: float  # a task's first page issued to its dependencies met (negative: after them)


def op_streams(stamps: np.ndarray, pages: np.ndarray, ops: list[str], ctas: np.ndarray,
               step: int) -> list[OpStream]:
    """Per op with weight pages, from a step's task stamps `stamps[step]` ([steps, tasks, 3])
    and the page stamps ([ctas, pages, 4]): a page belongs to the task of its CTA during which
    compute saw it. In the order the ops first run."""
    st = stamps[step].astype(np.int64)
    out = []
    for op in dict.fromkeys(ops):
        staging, n_pages, compute, first, stall, flight, lead = [], [], [], [], [], [], []
        for task in (i for i, o in enumerate(ops) if o == op):
            met, done = st[task, DEPS_MET], st[task, DONE]
            log = pages[ctas[task]].astype(np.int64)
            mine = log[(log[:, SEEN] >= met) & (log[:, SEEN] <= done) & (log[:, WAITING] > 0)]
            if not len(mine):
                continue
            staging.append(st[task, START] - met)
            n_pages.append(len(mine))
            compute.extend(mine[:, RELEASED] - mine[:, SEEN])
            first.append(mine[0, RELEASED] - mine[0, SEEN])
            lead.append(met - mine[0, ISSUED])
            stall.append((mine[:, SEEN] - mine[:, WAITING]).sum())
            late = mine[mine[:, ISSUED] > met]
            flight.extend(late[:, SEEN] - late[:, ISSUED])
        if n_pages:
            out.append(OpStream(op, len(n_pages), np.mean(staging) / 1e3, float(np.mean(n_pages)),
                                np.mean(compute) / 1e3, np.mean(first) / 1e3, np.mean(stall) / 1e3,
                                np.mean(flight) / 1e3 if flight else float("nan"),
                                np.mean(lead) / 1e3))
    return out


def random_engine(artifact: Path) -> Any:
    """ARTIFACT loaded on the GPU with random weights (seed 0, as `tilertc bench` draws them)."""
    import torch

    from tilertc.artifact import model_spec, read_manifest
    from tilertc.engine import Engine
    from tilertc.ir.build import build_graph
    from tilertc.ir.weights import random_weights

    if not torch.cuda.is_available():
        raise SystemExit(f"{artifact}: running a probe needs a CUDA GPU, and torch sees none here")
    m = read_manifest(artifact)
    weights = random_weights(build_graph(model_spec(m), m["max_seq_len"]), seed=0, device="cuda")
    return Engine.load(artifact, weights=weights, device="cuda")


def profile_at(engine: Any, context: int, spare_steps: int = 0, steps: int = STEPS) -> Any:
    """Decode `steps` steps with the task stamps on (after a warm-up decode: caches, clocks)
    from position `context`, with `spare_steps` rows of stamp room past them: the cache's
    earlier rows are whatever the arena holds (zeros), which costs attention the same time as
    a prefilled context. Needs the GPU."""
    from tilertc.profile import profile_engine

    engine.position = context
    list(engine.generate([1], max_new_tokens=8))
    return profile_engine(engine, 5, steps, spare_steps)


def stamped_profile(engine: Any, words: int, context: int = 0) -> tuple[Any, np.ndarray]:
    """`profile_at` with room for `words` stamps per CTA past the profiled steps; the profile
    and the CTAs' words [ctas, words]. Needs the GPU."""
    n, ctas = engine.tasks.shape[0], engine.stream_offsets.numel() - 1
    profile = profile_at(engine, context, -(-ctas * words // (n * 3)))
    return profile, profile.spare.reshape(-1)[:ctas * words].reshape(ctas, words)


def run(artifacts: list[Path], step: int, context: int) -> None:
    import torch

    from tilertc.artifact import model_spec, read_manifest
    from tilertc.engine import Engine
    from tilertc.ir.build import build_graph
    from tilertc.ir.weights import random_weights
    from tilertc.profile import fold_layer

    by_model: dict[str, list[Path]] = {}
    for a in artifacts:
        by_model.setdefault(read_manifest(a)["model"]["spec_hash"], []).append(a)
    for group in by_model.values():
        m = read_manifest(group[0])
        weights = random_weights(build_graph(model_spec(m), m["max_seq_len"]), seed=0,
                                 device="cuda")
        for a in group:
            engine = Engine.load(a, weights=weights, device="cuda")
            pages = probe_pages(a)
            profile, words = stamped_profile(engine, pages * 4, context)
            log = words.reshape(words.shape[0], pages, 4)
            ops = [fold_layer(o) for o in profile.ops]
            print(f"== {a} (step {step} of {STEPS}, context {context}; µs)")
            print(f"  {'op':28s} {'tasks':>6s} {'staging':>8s} {'pages':>6s} {'compute/page':>13s}"
                  f" {'first page':>11s} {'stall/task':>11s} {'issue->seen':>12s}"
                  f" {'issue->met':>11s}")
            rows = op_streams(profile.stamps, log, ops, profile.ctas, step)
            if not rows:  # session 58's 64 pages a SM ended inside step 0: an empty table
                print(f"  no stamped page lies in step {step}: the {pages} pages stamped a SM "
                      f"end before it; build with a larger --pages, or run --step 0")
            for r in rows:
                print(f"  {r.op:28s} {r.tasks:6d} {r.staging_us:8.2f} {r.pages:6.1f} "
                      f"{r.page_compute_us:13.2f} {r.first_page_us:11.2f} {r.stall_us:11.2f} "
                      f"{r.flight_us:12.2f} {r.lead_us:11.2f}")
            del engine
            torch.cuda.empty_cache()


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The stamped decode's --step and --context, shared by the probes' `run`."""
    parser.add_argument("--step", type=int, default=1,
                        help=f"which of the {STEPS} steps [default: 1]")
    parser.add_argument("--context", type=int, default=0,
                        help="the position the stamped steps start from [default: 0]")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="an instrumented variant of ARTIFACT in OUT (needs nvcc)")
    b.add_argument("artifact", type=Path)
    b.add_argument("out", type=Path)
    b.add_argument("--pages", type=int, default=8192,
                   help="pages stamped per SM from a launch's start [default: 8192]")
    r = sub.add_parser("run", help="decode with the stamps on and print per op (needs a GPU)")
    r.add_argument("artifacts", type=Path, nargs="+")
    add_run_options(r)
    args = parser.parse_args(argv)
    if args.command == "build":
        print(summary(args.out, build(args.artifact, args.out, args.pages)))
    else:
        run(args.artifacts, args.step, args.context)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
