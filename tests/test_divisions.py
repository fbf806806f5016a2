"""tools/divisions.py: integer divisions of an `nvdisasm -g` listing by source line, on a
made-up listing."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tools"))
from divisions import division_lines  # noqa: E402

# Line 12 of kernel.cu: a signed and an unsigned 32-bit division; line 30: a 64-bit division
# call and a float reciprocal (not an integer division); a line of another file: not counted;
# line 12 again, inlined elsewhere: counted with the first.
LISTING = """
	//## File "/a/kernel.cu", line 12 inlined at "/a/kernel.cu", line 90
        /*0100*/                   I2F.RP R15, R17 ;
        /*0110*/                   MUFU.RCP R15, R15 ;
        /*0120*/                   I2F.U32.RP R8, R11 ;
	//## File "/a/kernel.cu", line 30
        /*0130*/                   CALL.REL.NOINC `($__internal_1_$__cuda_sm20_div_s64) ;
        /*0140*/                   MUFU.RCP R2, R3 ;
        /*0150*/          CALL.REL.NOINC `($__internal_3_$__cuda_sm3x_div_rn_noftz_f32_slowpath) ;
	//## File "/usr/include/cuda/std/detail/x.h", line 12
        /*0160*/                   I2F.RP R4, R5 ;
	//## File "/a/kernel.cu", line 12
        /*0170*/                   I2F.RP R6, R7 ;
"""


def test_divisions_are_counted_per_line_of_the_kernel_source() -> None:
    assert division_lines(LISTING) == {12: 3, 30: 1}


def test_another_source_file_can_be_asked_for() -> None:
    assert division_lines(LISTING, source="x.h") == {12: 1}
