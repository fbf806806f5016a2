"""Which row-segment tiles a schedule needs: the pass decisions turned into tile shapes.

In `decode/matvec.cuh: run_matvec` a ring page holds `page_bytes // row_bytes` whole weight rows;
the warps of a page group (compute warps / page groups) share the page's rows, and when a page has
fewer rows than warps, `warps_per_row` warps (a power of two) split each row into equal
contiguous segments of 16-byte pieces (8 bf16), the last one possibly shorter. One warp
multiplies one segment by the staged input vector: that is the tile TileLang generates, one per
distinct segment length. A length this module misses still runs, on the CUDA loop (the seam's
fallback in compose.py), so the rule below only has to match the kernel's for coverage.
"""

from __future__ import annotations

from tilertc.passes.program import Program
from tilertc.passes.tiling import row_bytes

MATVEC_OPCODES = ("norm_matvec", "matvec_add")
PIECE_ELEMENTS = 8  # bf16 weights per 16-byte piece


def warps_per_row(rows_in_page: int, group_warps: int) -> int:
    """decode/pages.cuh's warps_per_row: double while twice as many warps still fit the group."""
    wpr = 1
    while wpr * 2 * rows_in_page <= group_warps:
        wpr *= 2
    return wpr


def row_segments(k_pieces: int, wpr: int) -> list[int]:
    """Lengths (pieces) of the segments `wpr` warps cut a row of `k_pieces` pieces into."""
    seg = -(-k_pieces // wpr)
    return [n for j in range(wpr) if (n := min(seg, k_pieces - j * seg)) > 0]


def segment_lengths(program: Program) -> dict[int, list[str]]:
    """{segment length in pieces: names of the matrix-vector ops with segments of that length}."""
    cfg = program.config
    group_warps = cfg["compute_warps"] // cfg["page_groups"]
    task_rows: dict[str, set[int]] = {}
    for t in program.tasks:
        task_rows.setdefault(t.op, set()).add(t.rows[1] - t.rows[0])
    out: dict[int, list[str]] = {}
    for op in program.graph.ops():
        if op.opcode not in MATVEC_OPCODES:
            continue
        k_pieces = op.attrs["K"] // PIECE_ELEMENTS
        rows_per_page = cfg["page_bytes"] // row_bytes(program, op)
        for rows in sorted(task_rows[op.name]):
            for n in row_segments(k_pieces, warps_per_row(min(rows_per_page, rows), group_warps)):
                names = out.setdefault(n, [])
                if op.name not in names:
                    names.append(op.name)
    return dict(sorted(out.items()))
