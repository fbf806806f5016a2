"""The numbers `tilertc bench` reports, computed from raw timings: no GPU needed.

Kept apart from the GPU run (`tilertc.bench`) so that every figure in a report (median and p90
per token, % of the measured roofline, speedups, the JSON written to bench.json) is checked on
a CPU against hand-made inputs.

Conventions (docs/performance.md, "How to benchmark"):
- a token's time is the interval between the arrivals of consecutive tokens on the host;
  tokens/s/user follows from the median;
- bytes per token are the model's, the same for every system: the weights one step reads (each
  once, the embedding one row) plus the KV cache at the mean context of the timed tokens;
- % of roofline is the read rate a system's median token implies over the bandwidth ceiling
  measured in the same run.
"""

from __future__ import annotations

import platform
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from tilertc.inspect import charge_reads, human_bytes
from tilertc.ir.build import build_graph
from tilertc.ir.graph import TensorKind
from tilertc.model_specs.spec import ModelSpec

SCHEMA_VERSION = 2


@dataclass(frozen=True)
class Timing:
    """Per-token decode times of one system at one point."""

    ms_median: float
    ms_p90: float
    tokens: int  # how many token times the statistics are over
    ms_mean: float | None = None  # where the raw times are known

    @classmethod
    def from_seconds(cls, seconds: Sequence[float]) -> Timing:
        if len(seconds) == 0:
            raise ValueError("no token times to summarize")
        ms = 1e3 * np.asarray(seconds, dtype=np.float64)
        return cls(float(np.median(ms)), float(np.percentile(ms, 90)), len(ms), float(ms.mean()))

    @property
    def tokens_per_s(self) -> float:
        return 1e3 / self.ms_median

    @property
    def batched_arrivals(self) -> bool:
        """Whether tokens came in bursts (several per host poll of the token ring): then most
        intervals are a few µs and the median falls far below the mean."""
        return self.ms_mean is not None and self.ms_median < 0.5 * self.ms_mean


def arrival_intervals(start: float, arrivals: Sequence[float]) -> list[float]:
    """Seconds per token from the host clock at which each token arrived: the first from
    `start` (it carries the launch), the rest from the token before."""
    times = [start, *arrivals]
    if any(b < a for a, b in zip(times, times[1:], strict=False)):
        raise ValueError("arrival times must not decrease")
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def roofline_pct(bytes_per_token: int, ms_per_token: float, ceiling_bytes_per_s: float) -> float:
    """The read rate `bytes_per_token` every `ms_per_token` implies, in % of the ceiling."""
    return 100.0 * bytes_per_token / (ms_per_token / 1e3) / ceiling_bytes_per_s


@dataclass(frozen=True)
class TokenBytes:
    """What one decode token must read from HBM at least."""

    weights: int
    kv: int
    kv_context: int  # the context the KV bytes are counted at

    @property
    def total(self) -> int:
        return self.weights + self.kv


def token_bytes(spec: ModelSpec, context: int, gen: int) -> TokenBytes:
    """Bytes one token reads over a run that decodes `gen` tokens after a `context`-token prompt:
    the weights as `tilertc inspect` counts them, and the KV cache at the mean context the timed
    tokens attend over (KV reads grow linearly with the context)."""
    kv_context = context + gen // 2
    graph = build_graph(spec, kv_context)
    charged = charge_reads(graph, kv_context).values()
    return TokenBytes(sum(c[TensorKind.WEIGHT] for c in charged),
                      sum(c[TensorKind.KV_CACHE] for c in charged), kv_context)


@dataclass(frozen=True)
class Prediction:
    """The cost model's time per token for the benchmarked schedule (passes/cost.py)."""

    step_ms: float
    roofline_ms: float
    context: int  # the KV capacity the schedule was made for


@dataclass
class SystemRow:
    """One system at one point: its timing, or why it did not run."""

    name: str
    timing: Timing | None
    skipped: str | None = None
    detail: str = ""  # what the system is, as its runner names it
    roofline_pct: float | None = None
    speedup_vs: dict[str, float] = field(default_factory=dict)  # other's ms / this ms

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "detail": self.detail,
                               "status": "skipped" if self.timing is None else "ok"}
        if self.timing is None:
            out["reason"] = self.skipped
            return out
        t = self.timing
        out.update(ms_per_token_median=t.ms_median, ms_per_token_p90=t.ms_p90,
                   ms_per_token_mean=t.ms_mean, tokens_timed=t.tokens,
                   tokens_per_s_per_user=t.tokens_per_s, roofline_pct=self.roofline_pct,
                   speedup_vs=self.speedup_vs)
        return out


@dataclass
class BenchPoint:
    """All systems at one (context, gen) point, with the derived figures filled in."""

    context: int
    gen: int
    bytes: TokenBytes
    ceiling_bytes_per_s: float
    systems: list[SystemRow]
    prediction: Prediction | None = None

    @property
    def roofline_ms(self) -> float:
        """The time a token's bytes take at the measured ceiling."""
        return self.bytes.total / self.ceiling_bytes_per_s * 1e3

    def row(self, name: str) -> SystemRow:
        return next(r for r in self.systems if r.name == name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "context": self.context, "gen": self.gen,
            "bytes_per_token": {"weights": self.bytes.weights, "kv": self.bytes.kv,
                                "total": self.bytes.total, "kv_context": self.bytes.kv_context},
            "roofline_ms_per_token": self.roofline_ms,
            "roofline_tokens_per_s": 1e3 / self.roofline_ms,
            "prediction": asdict(self.prediction) if self.prediction else None,
            "systems": [r.to_dict() for r in self.systems],
        }


def make_point(context: int, gen: int, nbytes: TokenBytes, ceiling_bytes_per_s: float,
               results: Mapping[str, Timing | str], details: Mapping[str, str] | None = None,
               prediction: Prediction | None = None) -> BenchPoint:
    """A point from each system's timing (or the reason it was skipped, a string), in order."""
    details = details or {}
    rows = [SystemRow(name, r if isinstance(r, Timing) else None,
                      r if isinstance(r, str) else None, details.get(name, ""))
            for name, r in results.items()]
    timed = [r for r in rows if r.timing is not None]
    for r in timed:
        r.roofline_pct = roofline_pct(nbytes.total, r.timing.ms_median, ceiling_bytes_per_s)
        r.speedup_vs = {o.name: o.timing.ms_median / r.timing.ms_median
                        for o in timed if o is not r}
    return BenchPoint(context, gen, nbytes, ceiling_bytes_per_s, rows, prediction)


@dataclass
class BenchReport:
    """Everything bench.json holds."""

    model: dict[str, Any]  # name, spec_hash
    artifact: dict[str, Any]  # path, hash, max_seq_len, options
    device: dict[str, Any]  # name, torch, cuda
    weights: str  # where the weights came from
    ceiling: dict[str, Any]  # bytes_per_s, method
    gate: dict[str, Any]  # the correctness gate's findings
    points: list[BenchPoint]
    command: str = ""
    created: str = ""
    profile: dict[str, Any] | None = None
    kernels: dict[str, Any] | None = None  # per kernel system: its artifact and gate

    def to_dict(self) -> dict[str, Any]:
        from tilertc import __version__

        return {"schema_version": SCHEMA_VERSION, "tilertc_version": __version__,
                "created": self.created, "command": self.command, "host": platform.node(),
                "model": self.model, "artifact": self.artifact, "device": self.device,
                "weights": self.weights, "ceiling": self.ceiling, "gate": self.gate,
                "points": [p.to_dict() for p in self.points], "profile": self.profile,
                "kernels": self.kernels}


def print_point(point: BenchPoint, console: Console) -> None:
    """One table per point: the systems, then the ceiling and the cost model's prediction."""
    table = Table(title=f"context {point.context}, {point.gen} tokens decoded: "
                        f"{human_bytes(point.bytes.total)} read per token",
                  title_justify="left")
    for name in ("system", "ms/token median", "p90", "tokens/s/user", "% of roofline",
                 "tilertc speedup"):
        table.add_column(name, justify="left" if name == "system" else "right")
    for r in point.systems:
        if r.timing is None:
            table.add_row(r.name, "[yellow]skipped", "", "", "", "")
            continue
        t = r.timing
        vs = r.speedup_vs.get("tilertc")
        table.add_row(r.name, f"{t.ms_median:.3f}", f"{t.ms_p90:.3f}", f"{t.tokens_per_s:.1f}",
                      f"{r.roofline_pct:.1f}", "" if vs is None else f"{1 / vs:.2f}")
    table.add_row("measured roofline", f"{point.roofline_ms:.3f}", "",
                  f"{1e3 / point.roofline_ms:.1f}", "100.0", "", style="dim")
    if point.prediction is not None:
        p = point.prediction
        table.add_row("tilertc predicted", f"{p.step_ms:.3f}", "", f"{1e3 / p.step_ms:.1f}",
                      f"{100 * point.roofline_ms / p.step_ms:.1f}", "", style="dim")
    console.print(table)
    for r in point.systems:
        if r.timing is not None and r.detail:
            console.print(f"{r.name}: {r.detail}", style="dim", highlight=False)
    for r in point.systems:
        if r.timing is None:
            console.print(f"[yellow]{r.name} skipped:[/yellow] {r.skipped}", highlight=False)
        elif r.timing.batched_arrivals:
            console.print(f"[yellow]{r.name}: tokens arrived faster than the host polls for "
                          f"them, so single intervals are not token times; the mean, "
                          f"{r.timing.ms_mean:.4f} ms/token, is the sounder figure",
                          highlight=False)
