"""Global loads a kernel waits for at once, from its SASS:

    cuobjdump -sass ARTIFACT/kernel.cubin > kernel.sass      # cuobjdump from the CUDA toolkit
    python tools/load_use.py kernel.sass [--within N]

Lists every load from global (or generic) memory whose destination register an instruction
within the next N (default 3) reads or writes: that instruction waits for the load's whole
round trip to L2, so a loop whose loads are each used right away pays a round trip an
iteration instead of one for the loop (docs/performance.md, session 36, says what it found in
the MLA chain). Many hits are benign (a task field read from the L1-cached task table, a one-off
load); read the SASS around an address to see which loop it is in.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]+)\*/\s*(.*?)\s*;")
PREDICATE = re.compile(r"^@!?U?P[T0-9]+\s+")
LOAD = re.compile(r"^(LDG|LD)\.\S*\s+R(\d+),")


@dataclass(frozen=True)
class LoadUse:
    """A load at `address` whose register the instruction `distance` later names."""

    address: str
    load: str
    distance: int
    use: str


def instructions(sass: str) -> list[tuple[str, str]]:
    """(address, instruction without its predicate) of each SASS line that holds one."""
    out = []
    for line in sass.splitlines():
        m = INSTRUCTION.match(line)
        if m:
            out.append((m.group(1), PREDICATE.sub("", m.group(2))))
    return out


def touches(instruction: str, register: str) -> bool:
    """Whether `instruction` names R`register`: reading it waits for the load, and so does
    writing it (the scoreboard holds a register with a load outstanding)."""
    return re.search(rf"\bR{register}\b", instruction.partition(" ")[2]) is not None


def loads_used_at_once(sass: str, within: int = 3) -> list[LoadUse]:
    """Every global or generic load whose destination an instruction within `within` names."""
    code = instructions(sass)
    found = []
    for i, (address, instruction) in enumerate(code):
        m = LOAD.match(instruction)
        if not m:
            continue
        for j in range(i + 1, min(i + 1 + within, len(code))):
            if touches(code[j][1], m.group(2)):
                found.append(LoadUse(address, instruction, j - i, code[j][1]))
                break
    return found


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sass", type=Path, help="the output of `cuobjdump -sass kernel.cubin`")
    parser.add_argument("--within", type=int, default=3, help="instructions [default: 3]")
    args = parser.parse_args(argv)
    found = loads_used_at_once(args.sass.read_text(), args.within)
    for f in found:
        print(f"{f.address}: {f.load}  -> +{f.distance}: {f.use}")
    print(f"{len(found)} loads used within {args.within} instructions", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
