"""tools/load_use.py: which loads of a SASS listing are used at once, on made-up listings."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tools"))
from load_use import loads_used_at_once  # noqa: E402

# A loop body whose load feeds the next FMA (waited for at once), a load whose register only a
# later instruction reads, a predicated load read by a store, and a load's register written over
# (which waits for the load as a read does).
SASS = """
        /*0100*/                   LDG.E.64.STRONG.GPU R12, desc[UR6][R12.64] ;  /* 0x0 */
        /*0110*/                   ISETP.NE.AND P1, PT, R68, 0x2, PT ;
        /*0120*/                   FFMA R10, R17.reuse, R12, R10 ;
        /*0130*/                   LDG.E.STRONG.GPU R69, desc[UR6][R24.64] ;
        /*0140*/                   IMAD.MOV.U32 R81, RZ, RZ, R68 ;
        /*0150*/                   HMMA.16816.F32.BF16 R28, R28, R32, RZ ;
        /*0160*/                   NOP ;
        /*0170*/                   IADD3 R1, R69, 0x1, RZ ;
        /*0180*/               @P0 LD.E R24, desc[UR6][R58.64+0x20] ;
        /*0190*/                   STG.E desc[UR6][R2.64], R24 ;
        /*01a0*/                   LDG.E R5, desc[UR6][R6.64] ;
        /*01b0*/                   MOV R5, RZ ;
        /*01c0*/                   FADD R7, R7, R5 ;
"""


def test_loads_read_within_the_window_are_found() -> None:
    found = loads_used_at_once(SASS, within=3)
    assert [(f.address, f.distance) for f in found] == [("0100", 2), ("0180", 1), ("01a0", 1)]
    assert found[0].use.startswith("FFMA")


def test_a_wider_window_finds_the_later_use() -> None:
    found = {f.address: f.distance for f in loads_used_at_once(SASS, within=4)}
    assert found["0130"] == 4
