"""The scheduled program: what the passes build up and the backends realize.

A `Program` starts as the op graph of one decode step plus a target, and each pass adds its
decisions: fusion rewrites the graph into fused ops, tiling splits every fused op into `Task`s,
residency places buffers and sizes the weight ring, roles assigns warps, scheduling puts every
task on an SM (one ordered `streams[sm]` per SM), synchronization adds the counters tasks
wait on and signal. `decisions` keeps a readable line per decision for `tilertc explain`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tilertc.ir.graph import Graph
from tilertc.ir.target import Target
from tilertc.model_specs.spec import ModelSpec


class ScheduleError(ValueError):
    """A program that cannot be scheduled for the target; the message names the op and the limit."""


@dataclass
class WeightSegment:
    """Rows [row0, row1) of one weight tensor, as a task reads them; with `cols`, only the
    columns [c0, c1) of each (a split-K FFN task's slice of the down projection), packed as
    rows of c1 - c0 values."""

    tensor: str  # graph tensor name
    row0: int
    row1: int
    cols: tuple[int, int] | None = None


@dataclass
class Task:
    """One unit of work on one SM: a tile of a fused op."""

    op: str  # fused op name
    opcode: str
    index: int  # position among its op's tasks
    rows: tuple[int, int]  # output rows of the op (attention: kv-head range)
    # Weight rows this task streams, packed contiguously in this order. Segments of one task
    # are interleaved row by row when the op's `interleave` attr is set (gate/up pairs).
    segments: list[WeightSegment] = field(default_factory=list)
    weight_bytes: int = 0
    other_bytes: int = 0  # KV cache and activations read from global memory
    sm: int = -1
    weight_offset: int = -1  # bytes into the packed weight buffer
    # A routed task's static rows (a moe_down_add's shared expert), when weight_offset is where
    # its routed rows lie in expert 0's part of its op's region.
    static_offset: int = -1
    waits: list[tuple[int, int]] = field(default_factory=list)  # (counter, increments per step)
    signal: int = -1  # counter incremented once per step when the task is done
    # Chunked attention: the counter the task arrives on; only the group's last arrival signals.
    arrive: int = -1
    # Tensor parallelism: the counter (in every rank's memory) on which the task's copies on all
    # ranks arrive once they have published their part to every rank; the task waits until all
    # tp have (passes/synchronization.py).
    exchange: int = -1
    est_ns: float = 0.0

    @property
    def key(self) -> str:
        return f"{self.op}#{self.index}"


@dataclass
class Counter:
    name: str  # the fused op whose tasks signal it
    per_step: int  # increments per decode step (its number of tasks)


@dataclass
class Buffer:
    """A global-memory buffer other than the packed weights (activations, caches, scratch)."""

    name: str
    offset: int  # elements into its arena
    numel: int
    dtype: str
    arena: str  # "act" (fp32 activations), "kv" (bf16 caches)


@dataclass
class Program:
    spec: ModelSpec
    graph: Graph
    target: Target
    tp: int = 1
    tasks: list[Task] = field(default_factory=list)
    streams: list[list[int]] = field(default_factory=list)  # per SM: task indices in order
    counters: list[Counter] = field(default_factory=list)
    buffers: dict[str, Buffer] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)  # ring, warps, smem plan
    decisions: list[str] = field(default_factory=list)

    def decide(self, pass_name: str, text: str) -> None:
        self.decisions.append(f"[{pass_name}] {text}")

    def tasks_of(self, op: str) -> list[Task]:
        return [t for t in self.tasks if t.op == op]

    @property
    def weight_bytes(self) -> int:
        return sum(t.weight_bytes for t in self.tasks)
