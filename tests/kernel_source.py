"""Pieces of the device library (backends/cuda/decode/), cut out by their first lines, for the
harnesses that run the kernel's own device code on the host (tests/host_kernel.cpp)."""

from __future__ import annotations

from tilertc.backends.cuda.codegen import library_source


class KernelSource:
    """The device library as one text (its parts in order), and the ways the harnesses cut it."""

    def __init__(self) -> None:
        self.src = library_source()

    def between(self, start: str, end: str) -> str:
        """From the line that begins with `start` up to `end`."""
        return self.src[self.src.index(start):self.src.index(end)]

    def definition(self, start: str) -> str:
        """A function or struct: from `start` to its closing brace at the start of a line."""
        at = self.src.index(start)
        return (self.src[at:self.src.index("\n}", at) + 2]
                + (";\n" if start.startswith("struct") else "\n"))

    def line(self, start: str) -> str:
        at = self.src.index(start)
        return self.src[at:self.src.index("\n", at) + 1]

    def prelude(self) -> list[str]:
        """What every harness needs: the task table's and parameters' enums, warp_sum and
        warp_max, the shared-memory struct with its flag index, and Divisor."""
        enums = self.src.index("enum Opcode")
        return [self.src[enums:self.src.index("\n", self.src.index("enum ErrorCode"))],
                self.definition("__device__ __forceinline__ float warp_sum"),
                self.definition("__device__ __forceinline__ float warp_max"),
                self.line("constexpr int FLAG_HOLD"), self.definition("struct Shared {"),
                self.definition("struct Divisor {")]
