"""How a model's weight tasks fill the ring's pages, from its schedule (no GPU, no nvcc):

    python tools/page_fit.py MODEL [--weight-dtype fp8|bf16] [--tune KNOB=N ...]
                               [--layer-kind dense|moe]

For each matrix-vector op of one layer (and the lm_head): its row format, its tasks' rows, the
largest task's bytes and how many pages it streams (a page holds whole rows, or whole FP8 tile
units). A page costs a round of the compute warps however few rows it holds (a wait on the
ring, a pass over the staged input, a barrier), so a task whose last page holds a few rows
pays nearly a page's overhead for them: such ops are marked. docs/performance.md, session 42,
found two this way (MLA's v expansion with whole-group tasks, GLM-5's q absorption).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import tilertc
from tilertc.bench import parse_tuning
from tilertc.bench_layers import kind_overrides, layer_kinds
from tilertc.model_specs.hf import with_weight_dtype
from tilertc.passes.pipeline import make_program
from tilertc.passes.program import Program
from tilertc.passes.tiling import MATVEC, ROUTED, is_tiled, stream_row_bytes

NEARLY_EMPTY = 0.15  # a last page at most this full is marked


@dataclass(frozen=True)
class PageFit:
    """How the largest task of one kind of op fills ring pages."""

    kind: str  # the op's name past `layers.N.`
    format: str  # "rows" or "FP8 tiles"
    rows: tuple[int, int]  # its tasks' fewest and most rows
    task_bytes: int  # the largest task's weight bytes (a routed task's expected)
    pages: int
    last_fill: float  # of its last page, the share its bytes fill


def page_fits(program: Program) -> list[PageFit]:
    """One PageFit per kind of matrix-vector op (the first layer's), in program order."""
    page, out, seen = program.config["page_bytes"], [], set()
    for op in program.graph.ops():
        kind = op.name.split(".", 2)[-1]  # layers.N.<kind>
        if op.opcode not in (*MATVEC, *ROUTED) or kind in seen:
            continue
        seen.add(kind)
        tasks = program.tasks_of(op.name)
        unit = stream_row_bytes(program, op)  # what a page holds whole: a row or a tile unit
        usable = page // unit * unit
        most = max(t.weight_bytes for t in tasks)
        pages = -(-most // usable)
        rows = [t.rows[1] - t.rows[0] for t in tasks]
        out.append(PageFit(kind, "FP8 tiles" if is_tiled(program, op) else "rows",
                           (min(rows), max(rows)), most, pages,
                           (most - (pages - 1) * usable) / usable))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a built-in name or a config.json")
    ap.add_argument("--weight-dtype", choices=("fp8", "bf16"), default=None)
    ap.add_argument("--tune", action="append", default=[], metavar="KNOB=N")
    ap.add_argument("--layer-kind", choices=("dense", "moe"), default=None,
                    help="schedule a model of 2 layers of this kind (faster than the whole model)")
    args = ap.parse_args()
    spec = tilertc.load_spec(args.model)
    if args.layer_kind:
        if args.layer_kind not in layer_kinds(spec):
            ap.error(f"{spec.name} has no {args.layer_kind} layers")
        spec = tilertc.load_spec(args.model, overrides=kind_overrides(spec, args.layer_kind, 2))
    if args.weight_dtype:
        spec = with_weight_dtype(spec, args.weight_dtype)
    try:
        tuning = dict(parse_tuning(tuple(args.tune)))
    except ValueError as e:
        ap.error(f"--tune: {e}")
    program = make_program(spec, "h200", 1, 2048, tuning)
    print(f"{spec.name}: ring of {program.config['ring_pages']} pages x "
          f"{program.config['page_bytes']} B")
    for f in page_fits(program):
        mark = (f"  <- its last page {f.last_fill:.0%} full"
                if f.pages > 1 and f.last_fill <= NEARLY_EMPTY else "")
        print(f"  {f.kind:36s} {f.format:9s} tasks of {f.rows[0]}-{f.rows[1]} rows, "
              f"{f.task_bytes / 1024:6.1f} KB: {f.pages} pages{mark}")


if __name__ == "__main__":
    main()
