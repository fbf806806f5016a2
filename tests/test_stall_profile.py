"""tools/stall_profile.py: ncu's warp samples folded by task code and by function, on a made-up
kernel source, `nvdisasm -gi` listing and source page."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tools"))
from stall_profile import fold, functions_by_line, inline_chains  # noqa: E402

SOURCE = """\
__device__ __forceinline__ float dot(const float* x) {
  return x[0];
}
__device__ void run_matvec(const float* x) {
  float y = dot(x);
}
__device__ void run_compute() {
  run_matvec(nullptr);
  wait_deps();
}
extern "C" __global__ void __launch_bounds__(544, 1)
    tilertc_decode(const int* p) {
  run_compute();
}
""".splitlines()

F = '//## File "/a/kernel.cu"'
# 0x00: dot (line 2) inlined into run_matvec (5), into run_compute (8), into the kernel (13);
# 0x10: the same location (no comment); 0x20: run_compute's own line 9, inlined into the
# kernel; 0x30: a line of another file, then the kernel's line 13
LISTING = f"""
\t{F}, line 2 inlined at "/a/kernel.cu", line 5
\t{F}, line 5 inlined at "/a/kernel.cu", line 8
\t{F}, line 8 inlined at "/a/kernel.cu", line 13
\t{F}, line 13
        /*0000*/                   LDS R1, [R2] ;
        /*0010*/                   FADD R1, R1, R1 ;
\t{F}, line 9 inlined at "/a/kernel.cu", line 13
\t{F}, line 13
        /*0020*/                   BAR.SYNC 0x1 ;
\t//## File "/usr/include/x.h", line 4
\t{F}, line 13
        /*0030*/                   EXIT ;
"""

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_no_inst",
          "stall_barrier", "stall_no_inst (Not Issued)"]
ROWS = [HEADER,
        ["0x7f0000000000", "LDS", "10", "7", "0", "7"],
        ["0x7f0000000010", "FADD", "2", "0", "0", "0"],
        ["0x7f0000000020", "BAR", "20", "1", "19", "1"],
        ["0x7f0000000030", "EXIT", "0", "0", "0", "0"]]


def test_a_line_belongs_to_the_function_defined_above_it_and_the_kernel_is_named() -> None:
    owner = functions_by_line("\n".join(SOURCE))
    assert [owner[i] for i in (2, 5, 8, 9, 13)] == [
        "dot", "run_matvec", "run_compute", "run_compute", "tilertc_decode"]


def test_each_instruction_gets_its_chain_of_inlined_calls() -> None:
    chains = inline_chains(LISTING)
    assert chains == {0x00: [2, 5, 8, 13], 0x10: [2, 5, 8, 13], 0x20: [9, 13], 0x30: [13]}


def test_samples_fold_by_the_call_in_the_compute_loop_and_by_the_innermost_function() -> None:
    total, by_task, by_function = fold(ROWS, inline_chains(LISTING), SOURCE)
    assert total.samples == 32 and total.reasons == {"stall_no_inst": 8, "stall_barrier": 19}
    assert {k: v.samples for k, v in by_task.items()} == {
        "run_matvec(nullptr);": 12, "wait_deps();": 20}
    assert by_task["run_matvec(nullptr);"].reasons["stall_no_inst"] == 7
    assert {k: v.samples for k, v in by_function.items()} == {"dot": 12, "run_compute": 20}
