"""Integer divisions in a kernel's machine code, by line of its kernel.cu:

    python tools/divisions.py ARTIFACT [--top N]

Compiles ARTIFACT's kernel.cu again with line information (`nvcc -lineinfo`, otherwise as the
artifact was built), disassembles it (`nvdisasm -g`, from the CUDA toolkit or the `sass` extra)
and counts, per source line, the 32-bit integer divisions by values the compiler cannot see
(each starts with `I2F.RP` or `I2F.U32.RP` and is a chain of ~20 dependent instructions) and the
calls of the 64-bit division routines. A line's count is its copies in the inlined code, not
how often it runs: read the lines on a task's way to its loads, or in a page loop, first. Ten
such divisions on warp 0's way to an FP8 tile task's staging took 0.76 us a task
(docs/performance.md, session 61).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from tilertc.backends.cuda.codegen import compile_cubin

LOCATION = re.compile(r'//## File "([^"]+)", line (\d+)')
DIVISION = re.compile(r"\bI2F(\.U32)?\.RP\b"  # a 32-bit division's first instruction
                      r"|CALL\.\S+\s+`\(\$__internal_\d+_\$__cuda_sm\d+_(div|rem)_[su]64\)")


def division_lines(listing: str, source: str = "kernel.cu") -> Counter[int]:
    """Per line of `source` (the file's name, as the listing spells its path's end), the
    division sequences and 64-bit division calls that `nvdisasm -g` attributes to it."""
    counts: Counter[int] = Counter()
    line = None
    for text in listing.splitlines():
        m = LOCATION.search(text)
        if m:
            line = int(m.group(2)) if m.group(1).endswith(source) else None
        elif line is not None and DIVISION.search(text):
            counts[line] += 1
    return counts


def find_nvdisasm() -> str:
    """nvdisasm on PATH, in the CUDA toolkit, or from the `sass` extra's wheel."""
    for cand in (shutil.which("nvdisasm"), "/usr/local/cuda/bin/nvdisasm"):
        if cand and Path(cand).exists():
            return cand
    try:
        import nvidia.cu13  # the nvidia-cuda-nvdisasm wheel's home
        cand = Path(nvidia.cu13.__path__[0]) / "bin" / "nvdisasm"
        if cand.exists():
            return str(cand)
    except ImportError:
        pass
    raise FileNotFoundError("nvdisasm not found: install the `sass` extra or the CUDA toolkit")


def listing_of(artifact: Path, inline: bool = False) -> str:
    """`nvdisasm -g` of ARTIFACT's kernel.cu compiled with line information; with `inline`,
    `-gi`: each location with the chain of calls it was inlined into."""
    arch = json.loads((artifact / "manifest.json").read_text())["target"]["arch"]
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        compile_cubin(artifact / "kernel.cu", cubin, arch, extra_flags=["-lineinfo"])
        flag = "-gi" if inline else "-g"
        return subprocess.run([find_nvdisasm(), flag, "-c", str(cubin)], check=True,
                              capture_output=True, text=True).stdout


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path, help="an artifact (kernel.cu, manifest.json)")
    parser.add_argument("--top", type=int, default=40, help="lines to print [default: 40]")
    args = parser.parse_args(argv)
    counts = division_lines(listing_of(args.artifact))
    source = (args.artifact / "kernel.cu").read_text().splitlines()
    for line, n in sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:args.top]:
        print(f"{n:4d}  kernel.cu:{line}: {source[line - 1].strip()[:110]}")
    print(f"{sum(counts.values())} divisions on {len(counts)} lines", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
