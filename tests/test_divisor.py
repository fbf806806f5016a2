"""decode/shared.cuh: Divisor, the kernel's division by a task's fixed value through one
multiply-high, against Python's floor division, compiled on the host from the library's own
text."""

from __future__ import annotations

import random
import shutil
import subprocess
from pathlib import Path

import pytest
from kernel_source import KernelSource

# the step harness's own stand-in for __umulhi, so that both host builds multiply alike
UMULHI = next(line for line in (Path(__file__).parent / "host_kernel.cpp").read_text().splitlines()
              if line.startswith("static inline unsigned __umulhi("))
HOST = f"""#include <cstdint>
#include <cstdio>
#define __device__
#define __forceinline__ inline
{UMULHI}
"""
MAIN = """int main() {
  long long n, d;
  while (std::scanf("%lld %lld", &n, &d) == 2) std::printf("%d\\n", Divisor(d)(n));
}
"""


@pytest.fixture(scope="module")
def divide(tmp_path_factory: pytest.TempPathFactory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("needs a C++ compiler")
    out = tmp_path_factory.mktemp("divisor")
    src = out / "divisor.cpp"
    src.write_text(HOST + KernelSource().definition("struct Divisor {") + MAIN)
    subprocess.run([cxx, "-O1", "-std=c++17", "-o", str(out / "divisor"), str(src)], check=True,
                   capture_output=True, text=True)

    def run(pairs: list[tuple[int, int]]) -> list[int]:
        lines = "".join(f"{n} {d}\n" for n, d in pairs)
        done = subprocess.run([str(out / "divisor")], input=lines, check=True,
                              capture_output=True, text=True)
        return [int(q) for q in done.stdout.split()]

    return run


# head rows (MLA: 128, 192, 256, 512), units of a tile (3, 8), pieces' units, and odd ones
DIVISORS = [1, 2, 3, 5, 7, 8, 96, 128, 192, 255, 256, 384, 512, 1000, 4095, 4096, 65535]


def test_quotients_are_floor_division_wherever_n_d_fits_32_bits(divide) -> None:
    rng = random.Random(20261206)
    pairs = []
    for d in DIVISORS:
        top = ((1 << 32) - 1) // d  # the largest n the kernel may divide (n d < 2^32)...
        top = min(top, (1 << 31) - 1)  # ...that is an int
        ns = {0, 1, d - 1, d, d + 1, top, top - 1, top - d}
        ns |= {m * d + r for m in (rng.randrange(top // d + 1) for _ in range(50))
               for r in (0, d - 1)}
        ns |= {rng.randrange(top + 1) for _ in range(200)}
        pairs += [(n, d) for n in sorted(ns) if 0 <= n <= top]
    assert divide(pairs) == [n // d for n, d in pairs]


def test_past_32_bits_it_is_wrong_which_is_why_the_encoder_bounds_head_rows(divide) -> None:
    # n d = 2^33 - ...: n = 2 d - 1 takes the quotient 2 (backends/cuda/encode.py refuses a
    # head_matvec whose rows times head rows reach 2^32)
    n, d = 2 * 65535 - 1, 65535
    assert n * d >= 1 << 32
    assert divide([(n, d)]) == [n // d + 1]
