"""Where the kernel's warps stall, by the code they are in, from Nsight Compute's PC sampling:

    python tools/stall_profile.py run ARTIFACT OUT.csv [--context N]   # on a GPU machine (ncu)
    python tools/stall_profile.py report ARTIFACT OUT.csv [--top N]    # here (nvcc, nvdisasm)

`run` decodes ARTIFACT (random weights, from position N) under `ncu` (the WarpStateStats and
SourceCounters sections, clocks left alone): a warm-up launch, then one profiled launch of 8
steps; it writes ncu's source page as CSV, one row per SASS instruction with its warp samples by
stall reason (`stall_no_inst`: waiting for the instruction itself, `stall_long_sb`: for a global
load, `stall_barrier`: at a barrier, ...).
A sample is one warp of one SM sub-partition at one moment, so a row's count is the time warps
spent at that instruction, summed over warps and SMs.

`report` compiles ARTIFACT's kernel.cu again with line information (the same machine code: the
flag adds only tables), disassembles it with each instruction's chain of inlined calls
(`nvdisasm -gi`) and folds the samples twice: by the task code the instruction belongs to (the
outermost call it was inlined into from the compute loop `run_compute` or the loader's
`run_loader`, e.g. `run_matvec(...)`, `wait_deps(...)`) and by the innermost function (the
kernel.cu function its own line is in). docs/performance.md, session 69, read instruction fetch
(`stall_no_inst`) this way: ~3 % of the whole kernel's samples, but 19 % of MLA attention's and
41 % of the DSA scores' (their code, run once a layer on an SM, is fetched from L2 each time).
"""

from __future__ import annotations

import argparse
import csv
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

LOCATION = re.compile(r'//## File "[^"]*kernel\.cu", line (\d+)'
                      r'(?: inlined at "[^"]*kernel\.cu", line (\d+))?')
INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/")
FUNCTION = re.compile(r'^(?:template\s*<[^>]*>\s*)?(?:static\s+|extern "C"\s+)?'
                      r"(?:__device__|__global__)[^;(]*?\b(\w+)\s*\(")
CALLED = re.compile(r"\b(\w+)\s*\(")
ROOTS = ("run_compute", "run_loader")  # the loops whose calls name a task's code
SAMPLES = "Warp Stall Sampling (All Samples)"


def functions_by_line(source: str) -> list[str]:
    """For each line of kernel.cu (index 1 on), the device function whose definition it is in:
    the last definition that starts at or above it ('?' before the first). A kernel whose
    `__launch_bounds__` end its first line is named on the next."""
    lines = source.splitlines()
    names, current = ["?"], "?"
    for i, text in enumerate(lines):
        m = FUNCTION.match(text)
        if m and not text.rstrip().endswith(";"):
            current = m.group(1)
            if current == "__launch_bounds__" and i + 1 < len(lines):
                m = CALLED.search(lines[i + 1])
                current = m.group(1) if m else current
        names.append(current)
    return names


def inline_chains(listing: str) -> dict[int, list[int]]:
    """Per instruction offset of an `nvdisasm -gi` listing, its kernel.cu lines from its own
    outwards through the calls it was inlined into. nvdisasm writes a location where it changes:
    one comment per level, `line A inlined at line B`, `line B inlined at line C`, ..., the
    outermost without a caller; an instruction without comments keeps the one before's."""
    chains: dict[int, list[int]] = {}
    chain: list[int] = []
    fresh = True  # the next comment starts a new chain
    for text in listing.splitlines():
        m = LOCATION.search(text)
        if m:
            if fresh:
                chain, fresh = [int(m.group(1))], False
            if m.group(2):
                chain.append(int(m.group(2)))
            continue
        m = INSTRUCTION.match(text)
        if m:
            fresh = True
            if chain:
                chains[int(m.group(1), 16)] = chain
    return chains


@dataclass
class Stalls:
    """Samples of a piece of code: all, and by stall reason."""

    samples: int = 0
    reasons: Counter[str] = field(default_factory=Counter)

    def add(self, samples: int, reasons: dict[str, int]) -> None:
        self.samples += samples
        self.reasons.update(reasons)

    def top(self, n: int = 3) -> str:
        return ", ".join(f"{r.removeprefix('stall_')} {v}" for r, v in self.reasons.most_common(n))


def fold(rows: list[list[str]], chains: dict[int, list[int]], source: list[str]
         ) -> tuple[Stalls, dict[str, Stalls], dict[str, Stalls]]:
    """ncu's source rows (a header row, then one per instruction from the kernel's first, at
    absolute addresses) folded: the whole kernel, per task code (the call in ROOTS that the
    instruction was inlined from, as its line's text) and per innermost function."""
    header, body = rows[0], rows[1:]
    col = {name: i for i, name in enumerate(header)}
    reasons = [c for c in header if c.startswith("stall_") and "Not Issued" not in c]
    base = int(body[0][col["Address"]], 16)
    owner = functions_by_line("\n".join(source))
    total, by_task, by_function = Stalls(), defaultdict(Stalls), defaultdict(Stalls)
    for r in body:
        samples = int(r[col[SAMPLES]] or 0)
        if not samples:
            continue
        why = {c: int(r[col[c]] or 0) for c in reasons}
        chain = chains.get(int(r[col["Address"]], 16) - base, [])
        call = next((line for line in reversed(chain) if owner[line] in ROOTS), None)
        task = source[call - 1].strip() if call else "(the loop itself, or no line)"
        total.add(samples, why)
        by_task[task].add(samples, why)
        by_function[owner[chain[0]] if chain else "?"].add(samples, why)
    return total, by_task, by_function


def read_source_page(path: Path) -> list[list[str]]:
    """ncu's source page CSV: from the header row (`"Address","Source",...`) on."""
    rows = list(csv.reader(path.open()))
    start = next((i for i, r in enumerate(rows) if r[:2] == ["Address", "Source"]), None)
    if start is None:
        raise SystemExit(f"{path}: no \"Address\",\"Source\" header: not ncu's source page "
                         "(`ncu -i REPORT --page source --csv --print-source sass`)")
    return rows[start:]


def report(artifact: Path, page: Path, top: int) -> None:
    from divisions import listing_of

    source = (artifact / "kernel.cu").read_text().splitlines()
    listing = listing_of(artifact, inline=True)
    total, by_task, by_function = fold(read_source_page(page), inline_chains(listing), source)
    print(f"{artifact}: {total.samples} warp samples")
    for reason, n in total.reasons.most_common(8):
        print(f"  {reason:24s} {n:9d} {100 * n / total.samples:5.1f} %")
    for title, groups in (("task code", by_task), ("function", by_function)):
        print(f"\nby {title}: samples, share, instruction fetch (no_inst), top reasons")
        for name, s in sorted(groups.items(), key=lambda kv: -kv[1].samples)[:top]:
            print(f"  {100 * s.samples / total.samples:5.1f} % {s.samples:8d} "
                  f"{s.reasons['stall_no_inst']:7d}  {name[:60]:60s} {s.top()}")


def run(artifact: Path, out: Path, context: int) -> None:
    ncu = shutil.which("ncu")
    if ncu is None:
        raise SystemExit("ncu (Nsight Compute) is not on PATH: `run` needs a GPU machine with it")
    with tempfile.TemporaryDirectory() as tmp:
        rep = Path(tmp) / "stalls"
        subprocess.run([ncu, "--clock-control", "none", "--kernel-name", "tilertc_decode",
                        "--launch-skip", "1", "--launch-count", "1", "--section", "WarpStateStats",
                        "--section", "SourceCounters", "-f", "-o", str(rep), sys.executable,
                        str(Path(__file__).resolve()), "decode", str(artifact), "--context",
                        str(context)], check=True)
        with out.open("w") as f:
            subprocess.run([ncu, "-i", f"{rep}.ncu-rep", "--page", "source", "--csv",
                            "--print-source", "sass"], check=True, stdout=f)


def decode(artifact: Path, context: int) -> None:
    """Two launches of 8 steps from `context`: ncu skips the first (caches, clocks)."""
    from stream_probe import random_engine

    engine = random_engine(artifact)
    for _ in range(2):
        engine.position = context
        list(engine.generate([1], max_new_tokens=8))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="profile a decode under ncu into OUT.csv (needs a GPU)")
    d = sub.add_parser("decode", help="the decode that `run` profiles")
    for p in (r, d):
        p.add_argument("artifact", type=Path)
        if p is r:
            p.add_argument("out", type=Path)
        p.add_argument("--context", type=int, default=1024,
                       help="the position the launches start from [default: 1024]")
    t = sub.add_parser("report", help="fold OUT.csv by task code and function (nvcc, nvdisasm)")
    t.add_argument("artifact", type=Path)
    t.add_argument("page", type=Path, help="the CSV that `run` wrote")
    t.add_argument("--top", type=int, default=25, help="rows per table [default: 25]")
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args.artifact, args.out, args.context)
    elif args.command == "decode":
        decode(args.artifact, args.context)
    else:
        report(args.artifact, args.page, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
