"""`tilertc bench --per-layer`: one full-width decoder layer of each kind against its bytes, and
a projection (not a measurement) of the whole model's time per token on 8 GPUs.

A layer cannot be timed alone inside a persistent kernel, and a one-layer model's step is
mostly embedding, lm_head and sampling. So each layer kind (dense FFN, MoE) is timed by
difference: the model compiled with 1 layer and with 1 + N layers, all of that kind, each run
through the normal bench path (`run_bench`: its own compile, random weights, correctness gate
and timed token loop, same context and gen). A layer's time is (T(1 + N) - T(1)) / N; its bytes
the same difference of `token_bytes` (what `tilertc inspect` counts: every weight once, of a
MoE layer the top_k routed experts a token reads, plus the KV cache at the mean context); the
cost model's prediction for the same difference stands beside it. The variants keep the width
and the KV capacity and shrink the vocabulary to `LAYER_VOCAB`: embedding and lm_head are in
both variants and cancel in the difference, so a smaller vocabulary only makes them cheaper.

The projection scales each measured part to one rank of tensor parallelism 8 by the bytes the
passes' tp-8 sharding leaves a rank (the cost model's programs, `passes/sharding.py`): a part's
fixed costs (the cost model's op boundaries and attention chain, which do not shrink with the
bytes) stay, the rest of its measured time scales with its bytes, and each all-reduce adds an
assumed latency (`ALLREDUCE_US`). Beside it, a bound: the same with all of a part's measured
time above its roofline taken as fixed (the cost model's fixed costs are well below what the
profiles show, e.g. MLA's attention chain, so the projection leans optimistic and the truth
lies between the two). docs/performance.md, "Per layer", says the same with the sources of the
assumed latency and of TileRT's published figures.
"""

from __future__ import annotations

import dataclasses
import json
import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tilertc.baselines import free_bytes
from tilertc.bench import (
    BenchConfig,
    BenchError,
    Phase,
    capacity_for,
    check_model,
    quiet_phase,
    require_gpu,
    run_bench,
)
from tilertc.bench_report import SCHEMA_VERSION, BenchReport, roofline_pct
from tilertc.inspect import human_bytes
from tilertc.ir.build import build_graph
from tilertc.model_specs import load_spec
from tilertc.model_specs.hf import with_weight_dtype
from tilertc.model_specs.spec import ModelSpec
from tilertc.passes.program import ScheduleError

LAYER_VOCAB = 32000  # the variants' vocabulary: embedding and lm_head cancel in the difference
LAYERS_TIMED = 4  # N: the longer variant has 1 + N layers, fewer where they do not fit the GPU
TARGET_PCT = 75.0  # of the measured roofline, per layer
PROJECTED_TP = 8
# Assumed latency of one all-reduce of a hidden-size vector across 8 GPUs of one NVLink node, in
# µs: an assumption, not a measurement of ours. Published small-message figures on 8x H100 (the
# H200 has the same NVLink 4 and NVSwitch): PyTorch's one-shot intra-node all-reduce 6-15 µs in
# its pull request and ~17 µs measured by a user (pytorch/pytorch#114001, #131739); NCCL with
# NVLink SHARP in CUDA graphs ~6 µs on 2 GPUs, more on 8 (NVIDIA/nccl#1259). An exchange inside
# the persistent kernel needs no launch, so 10 µs sits in the published range and above what
# the links themselves take (a 28 KB fp32 vector is ~0.1 µs of NVLink 4). `--allreduce-us`
# changes it.
ALLREDUCE_US = 10.0
# The model's own lists of per-layer types, which a variant of another layer count cannot keep;
# the variants set their layer kinds with first_k_dense_replace / mlp_only_layers instead, and
# every layer runs its own DSA indexer (GLM-5's shared-selection layers are not a kind here).
PER_LAYER_LISTS = ("mlp_layer_types", "indexer_types", "index_topk_pattern")
GPU_MEMORY_SHARE = 0.9  # of the free GPU memory the weights may take (the rest: KV, activations)


@dataclass(frozen=True)
class Published:
    """A figure TileRT published, as published: not measured here, not on an H200."""

    model: str  # built-in spec name it compares with
    what: str
    tokens_per_s: float
    how_read: str
    source: str

    @property
    def ms_per_token(self) -> float:
        return 1e3 / self.tokens_per_s


TILERT_REPO = "https://github.com/tile-ai/TileRT/blob"
PUBLISHED = (
    Published("deepseek-v3.2", "TileRT v0.1.1, DeepSeek-V3.2-Exp, 8x B200, batch 1, 1K/1K, "
              "no MTP", 230, "read off the bar chart (no value printed), about ±5",
              f"{TILERT_REPO}/d18b3ef2880a8f980cb2ea0b031b32610d9a814b/assets/perf.png"),
    Published("glm-5", "TileRT v0.1.3, GLM-5-FP8, 8x B200, batch 1, 1K/1K, no MTP", 206,
              "read off the bar chart (no value printed), about ±3",
              f"{TILERT_REPO}/deeedc36aaca3ddc387d9fdc13d5dee8edf6db96/assets/"
              "glm5-without-mtp.png"),
    Published("glm-5", "TileRT v0.1.5, GLM-5.1-FP8, 8x B200, batch 1, 1K/1K, no MTP", 301,
              "printed on the chart",
              f"{TILERT_REPO}/a8368a681342d0686e76bbd2225b320f2fead8a2/assets/"
              "glm5_tilert_mtp.png"),
)


# -- the variants ---------------------------------------------------------------------------------
def layer_kinds(spec: ModelSpec) -> dict[str, int]:
    """The model's layer kinds and how many layers of each it has: "dense" (a dense FFN, also
    the leading layers of DeepSeek-style models), "moe"."""
    moe = sum(spec.is_moe_layer(i) for i in range(spec.num_layers))
    return {k: n for k, n in (("dense", spec.num_layers - moe), ("moe", moe)) if n}


def kind_overrides(spec: ModelSpec, kind: str, layers: int) -> dict[str, Any]:
    """Config overrides that make `spec` a model of `layers` layers all of `kind`, with the
    vocabulary shrunk to LAYER_VOCAB (where it is larger)."""
    out: dict[str, Any] = {"num_hidden_layers": layers,
                           "vocab_size": min(spec.vocab_size, LAYER_VOCAB)}
    out.update({key: None for key in PER_LAYER_LISTS if key in spec.hf_config})
    if spec.model_type == "glm_moe_dsa":
        out["index_topk_freq"] = 1  # every layer runs its own indexer (see PER_LAYER_LISTS)
    if spec.moe is None:
        return out
    if spec.moe.has_correction_bias:  # DeepSeek-style: the leading layers are the dense ones
        out["first_k_dense_replace"] = layers if kind == "dense" else 0
    else:  # Qwen3-MoE
        out.update(mlp_only_layers=list(range(layers)) if kind == "dense" else [],
                   decoder_sparse_step=1)
    return out


def variant_overrides(config: BenchConfig, spec: ModelSpec, kind: str,
                      layers: int) -> tuple[tuple[str, Any], ...]:
    """The bench's overrides and the variant's, checked: the spec they give must have `layers`
    layers, all of `kind` (a config with another per-layer list would not)."""
    overrides = {**dict(config.overrides), **kind_overrides(spec, kind, layers)}
    variant = load_spec(config.model, overrides)
    if layer_kinds(variant) != {kind: layers}:
        raise BenchError(f"{spec.name}: the {kind} variant of {layers} layer(s) came out as "
                         f"{layer_kinds(variant)}; its config must have another per-layer key "
                         "that --per-layer does not set")
    return tuple(overrides.items())


def variant_spec(config: BenchConfig, spec: ModelSpec, kind: str, layers: int,
                 small_vocab: bool = True) -> ModelSpec:
    """The variant of `layers` layers of `kind` as the bench compiles it (weight dtype too);
    with `small_vocab` false, at the model's own vocabulary."""
    overrides = dict(variant_overrides(config, spec, kind, layers))
    if not small_vocab:
        overrides["vocab_size"] = spec.vocab_size
    return with_weight_dtype(load_spec(config.model, overrides), config.weight_dtype)


def device_weight_bytes(spec: ModelSpec, max_seq_len: int) -> int:
    """GPU memory the bench's weights take at most: the engine's packed copy and the
    interpreter's (both the weights as stored, FP8 with its scales: `Interpreter.
    stored_weight`), and the largest op's weights widened to fp32 while it runs (`Interpreter.
    run`; a MoE layer's experts are widened one at a time, `OWN_WIDENING`, and not counted)."""
    from tilertc.ir.interpreter import OWN_WIDENING

    graph = build_graph(spec, max_seq_len)
    weights = {t.name: t for t in graph.weights()}
    scales = {t.attrs["scale_inv"] for t in weights.values() if "scale_inv" in t.attrs}
    # Widened per op: every weight not already fp32 (FP8 ones dequantized).
    widened = {name: 4 * t.numel for name, t in weights.items()
               if name not in scales and t.dtype != "fp32"}
    largest_op = max((sum(widened.get(i, 0) for i in op.inputs) for op in graph.ops()
                      if op.opcode not in OWN_WIDENING), default=0)
    return 2 * sum(t.nbytes for t in weights.values()) + largest_op


def layers_to_time(need: Callable[[int], int], budget: float, wanted: int | None,
                   what: str) -> int:
    """N: as asked (`wanted`), or LAYERS_TIMED or fewer where the weights of 1 + N layers
    (`need(N)` bytes, `device_weight_bytes`) do not fit in `budget` bytes of GPU memory."""
    def fits(n: int) -> bool:
        return need(n) <= budget

    if wanted is not None and fits(wanted):
        return wanted
    most = next((n for n in range(min(wanted or LAYERS_TIMED + 1, LAYERS_TIMED + 1) - 1, 0, -1)
                 if fits(n)), 0)
    if wanted is None and most:
        return most
    n = wanted or 1
    raise BenchError(
        f"1 + {n} {what} need {human_bytes(need(n))} of GPU memory for their weights (the "
        f"engine's copy, the interpreter's, one op widened to fp32), more than the "
        f"{human_bytes(budget)} the bench takes of what is free; "
        + (f"--layers-timed {most} fits" if most else
           "FP8 weights (--weight-dtype fp8) need less where the model has them"))


# -- the figures ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class VariantRun:
    """What the per-layer figures take from one variant's bench report."""

    layers: int
    ms: float  # mean ms per token (the median where the raw times are not known)
    weight_bytes: int  # per token, `token_bytes`
    kv_bytes: int
    predicted_ms: float
    ceiling_bytes_per_s: float

    @classmethod
    def from_report(cls, layers: int, report: BenchReport) -> VariantRun:
        point = report.points[0]
        timing, prediction = point.row("tilertc").timing, point.prediction
        if timing is None or prediction is None:
            raise BenchError(f"the {layers}-layer variant has no tilertc timing")
        # The mean, total time over tokens: a difference of two means is what the extra layers
        # add, however the host's polling bunches single arrivals.
        ms = timing.ms_mean if timing.ms_mean is not None else timing.ms_median
        return cls(layers, ms, point.bytes.weights, point.bytes.kv,
                   prediction.step_ms, report.ceiling["bytes_per_s"])


@dataclass(frozen=True)
class LayerTiming:
    """One layer of a kind: the difference of two variants over the layers between them."""

    kind: str
    count: int  # layers of this kind in the whole model
    layers_timed: int  # N
    ms: float
    base_ms: float  # the 1-layer variant's time per token
    weight_bytes: float
    kv_bytes: float
    ceiling_bytes_per_s: float  # the mean of the two runs' measured ceilings
    predicted_ms: float

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes

    @property
    def roofline_ms(self) -> float:
        return self.bytes / self.ceiling_bytes_per_s * 1e3

    @property
    def roofline_pct(self) -> float:
        return roofline_pct(self.bytes, self.ms, self.ceiling_bytes_per_s)

    @property
    def us_to_target(self) -> float:
        """How much shorter the layer must get to reach the target share of its roofline (0
        where it does): what a kernel change has to win, in the units the timelines use."""
        return max(0.0, self.ms - self.roofline_ms * 100 / TARGET_PCT) * 1e3

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "bytes": self.bytes, "roofline_ms": self.roofline_ms,
                "roofline_pct": self.roofline_pct, "target_pct": TARGET_PCT,
                "us_to_target": self.us_to_target}


def layer_timing(kind: str, count: int, one: VariantRun, more: VariantRun) -> LayerTiming:
    """A layer's time, bytes and prediction from the 1-layer and the (1 + N)-layer runs."""
    n = more.layers - one.layers
    if n < 1:
        raise ValueError(f"the longer variant must have more layers ({one.layers}, {more.layers})")
    ms = (more.ms - one.ms) / n
    if ms <= 0:
        raise BenchError(f"{kind}: {more.layers} layers took {more.ms:.4f} ms per token, "
                         f"{one.layers} layer {one.ms:.4f} ms: no positive time per layer; time "
                         "more layers (--layers-timed) or more tokens (--gen)")
    return LayerTiming(kind, count, n, ms, one.ms, (more.weight_bytes - one.weight_bytes) / n,
                       (more.kv_bytes - one.kv_bytes) / n,
                       (one.ceiling_bytes_per_s + more.ceiling_bytes_per_s) / 2,
                       (more.predicted_ms - one.predicted_ms) / n)


@dataclass(frozen=True)
class ShardCost:
    """What the cost model's program gives one rank: bytes read per token, fixed time (a
    boundary per op, attention's chain: what does not shrink with the bytes) and all-reduces."""

    bytes: float
    fixed_ns: float
    allreduces: float

    def minus(self, other: ShardCost, over: int = 1) -> ShardCost:
        """(self - other) / over: a difference of variants per layer."""
        return ShardCost((self.bytes - other.bytes) / over,
                         (self.fixed_ns - other.fixed_ns) / over,
                         (self.allreduces - other.allreduces) / over)


def shard_cost(spec: ModelSpec, tp: int, kv_context: int) -> ShardCost:
    """One rank's `ShardCost` of `spec` under the passes' tp sharding, KV read at kv_context."""
    from tilertc import schedule
    from tilertc.passes.cost import BOUNDARY_NS, chain_ns

    program = schedule(spec, "h200", tp, kv_context)
    ops = program.graph.ops()
    return ShardCost(sum(t.weight_bytes + t.other_bytes for t in program.tasks),
                     sum(BOUNDARY_NS + chain_ns(op) for op in ops),
                     len(program.config["sharding"]["allreduce_after"]))


def scaled_ms(measured_ms: float, at1: ShardCost, atp: ShardCost, allreduce_us: float) -> float:
    """A part measured on one GPU, at tp: its fixed time as the cost model has it at tp, the
    rest of the measured time scaled by the bytes a rank reads (the measured rate), plus the
    all-reduces. A measurement below the fixed time scales nothing (it counts as all fixed)."""
    streamed = max(measured_ms - at1.fixed_ns / 1e6, 0.0)
    return (atp.fixed_ns / 1e6 + streamed * atp.bytes / at1.bytes
            + atp.allreduces * allreduce_us / 1e3)


def excess_fixed_ms(measured_ms: float, roofline_ms: float, at1: ShardCost, atp: ShardCost,
                    allreduce_us: float) -> float:
    """A part at tp if all of its measured time above its roofline (its bytes at the measured
    ceiling) is fixed: that excess, plus its roofline scaled by the bytes a rank reads, plus the
    all-reduces. A bound on `scaled_ms`, never below it (where the cost model's fixed costs
    exceed the measured excess, the projection is the bound)."""
    bound = (max(measured_ms - roofline_ms, 0.0) + roofline_ms * atp.bytes / at1.bytes
             + atp.allreduces * allreduce_us / 1e3)
    return max(bound, scaled_ms(measured_ms, at1, atp, allreduce_us))


@dataclass(frozen=True)
class ProjectedPart:
    name: str
    count: int
    measured_ms: float  # one GPU, the variants' vocabulary for the rest
    bytes_tp1: float
    bytes_rank: float
    allreduces: float  # per part, at tp
    projected_ms: float
    excess_fixed_ms: float  # the bound: the measured excess over the roofline all fixed


@dataclass(frozen=True)
class Projection:
    """Whole-model time per token at tp PROJECTED_TP, from the per-layer measurements: a
    projection, not a measurement."""

    tp: int
    allreduce_us: float
    parts: list[ProjectedPart]
    published: list[Published]

    @property
    def total_ms(self) -> float:
        return sum(p.count * p.projected_ms for p in self.parts)

    @property
    def excess_fixed_total_ms(self) -> float:
        return sum(p.count * p.excess_fixed_ms for p in self.parts)

    def to_dict(self) -> dict[str, Any]:
        return {"label": "projection, not a measurement", "tp": self.tp,
                "allreduce_us": self.allreduce_us,
                "allreduce_us_is": "an assumption (docs/performance.md, Per layer)",
                "parts": [asdict(p) for p in self.parts], "total_ms": self.total_ms,
                "tokens_per_s": 1e3 / self.total_ms,
                "excess_fixed_total_ms": self.excess_fixed_total_ms,
                "excess_fixed_is": "a bound: each part's measured time above its roofline "
                                   "taken as fixed at tp, none of it shrinking with the bytes",
                "published": [{**asdict(p), "ms_per_token": p.ms_per_token}
                              for p in self.published]}


@dataclass(frozen=True)
class KindCosts:
    """The cost model's view of one kind: a layer at tp 1 and at tp, and the rest of the model
    (embedding, final norm, lm_head, sampling) as measured (tp 1, LAYER_VOCAB) and as projected
    (tp, the model's vocabulary; its argmax adds one exchange across ranks)."""

    layer_tp1: ShardCost
    layer_tp: ShardCost
    rest_tp1: ShardCost
    rest_tp: ShardCost


def project(timings: list[LayerTiming], costs: dict[str, KindCosts], allreduce_us: float,
            model: str, tp: int = PROJECTED_TP) -> Projection:
    """The whole model at tp: the rest (measured as T(1) - one layer, averaged over the kinds)
    plus every layer of each kind, each part scaled by `scaled_ms`."""
    rest = [(t.base_ms - t.ms, costs[t.kind], t.ceiling_bytes_per_s) for t in timings]

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    parts = [ProjectedPart(
        "embedding, lm_head, sampling", 1, mean([ms for ms, _, _ in rest]),
        mean([c.rest_tp1.bytes for _, c, _ in rest]), mean([c.rest_tp.bytes for _, c, _ in rest]),
        mean([c.rest_tp.allreduces for _, c, _ in rest]),
        mean([scaled_ms(ms, c.rest_tp1, c.rest_tp, allreduce_us) for ms, c, _ in rest]),
        mean([excess_fixed_ms(ms, c.rest_tp1.bytes / ceiling * 1e3, c.rest_tp1, c.rest_tp,
                              allreduce_us) for ms, c, ceiling in rest]))]
    for t in timings:
        c = costs[t.kind]
        parts.append(ProjectedPart(
            f"{t.kind} layer", t.count, t.ms, c.layer_tp1.bytes, c.layer_tp.bytes,
            c.layer_tp.allreduces, scaled_ms(t.ms, c.layer_tp1, c.layer_tp, allreduce_us),
            excess_fixed_ms(t.ms, t.roofline_ms, c.layer_tp1, c.layer_tp, allreduce_us)))
    return Projection(tp, allreduce_us, parts, [p for p in PUBLISHED if p.model == model])


def kind_costs(spec_of: Callable[..., ModelSpec], n: int, kv_context: int,
               tp: int = PROJECTED_TP) -> KindCosts:
    """`KindCosts` from the programs of the variants; `spec_of(layers)` gives the variant as
    timed, `spec_of(layers, False)` at the model's own vocabulary."""
    one, more = spec_of(1), spec_of(1 + n)
    layer_tp1 = shard_cost(more, 1, kv_context).minus(shard_cost(one, 1, kv_context), n)
    layer_tp = shard_cost(more, tp, kv_context).minus(shard_cost(one, tp, kv_context), n)
    rest_tp = shard_cost(spec_of(1, False), tp, kv_context).minus(layer_tp)
    return KindCosts(layer_tp1, layer_tp, shard_cost(one, 1, kv_context).minus(layer_tp1),
                     dataclasses.replace(rest_tp, allreduces=rest_tp.allreduces + 1))


# -- the report -----------------------------------------------------------------------------------
@dataclass
class PerLayerReport:
    """Everything bench.json holds for --per-layer."""

    model: dict[str, Any]
    context: int
    gen: int
    vocab_size: int  # the variants'
    weights: str
    timings: list[LayerTiming]
    projection: Projection | str  # or why there is none
    runs: dict[str, BenchReport]  # per variant ("moe-1", "moe-5", ...) its full bench report
    command: str = ""
    created: str = ""

    @property
    def device(self) -> dict[str, Any]:
        """The GPU the variants ran on (one run, one GPU: all of them the same)."""
        return next(iter(self.runs.values())).device

    def to_dict(self) -> dict[str, Any]:
        from tilertc import __version__

        p = self.projection
        return {"schema_version": SCHEMA_VERSION, "tilertc_version": __version__,
                "created": self.created, "command": self.command, "host": platform.node(),
                "model": self.model, "device": self.device,
                "weights": self.weights,
                "per_layer": {"context": self.context, "gen": self.gen,
                              "vocab_size": self.vocab_size,
                              "kinds": [t.to_dict() for t in self.timings],
                              "projection": (p.to_dict() if isinstance(p, Projection)
                                             else {"unavailable": p})},
                "runs": {name: r.to_dict() for name, r in self.runs.items()}}


def print_per_layer(report: PerLayerReport, console: Console) -> None:
    """A table of the measured layers, then the projection, labelled as one."""
    # the GPU in the title: a layer's share of its roofline depends on it (the latency-bound
    # steps do not shrink with the bandwidth; docs/performance.md, session 49: H100 against H200)
    table = Table(title=f"{report.model['name']} on {report.device['name']}, one layer of each "
                        f"kind ({report.weights}; "
                        f"context {report.context}, {report.gen} tokens decoded; measured)",
                  title_justify="left")
    for name in ("layer", "in model", "timed", "ms/layer", "bytes/layer", "roofline ms",
                 f"% of roofline (target {TARGET_PCT:.0f})", "µs to target", "predicted ms"):
        table.add_column(name, justify="left" if name == "layer" else "right")
    for t in report.timings:
        pct = f"{t.roofline_pct:.1f}"
        met = t.roofline_pct >= TARGET_PCT
        table.add_row(t.kind, str(t.count), f"1 vs {1 + t.layers_timed}", f"{t.ms:.4f}",
                      human_bytes(t.bytes), f"{t.roofline_ms:.4f}",
                      pct if met else f"[yellow]{pct}", "met" if met else f"{t.us_to_target:.1f}",
                      f"{t.predicted_ms:.4f}")
    console.print(table)
    if isinstance(report.projection, Projection):
        print_projection(report.projection, report.model["name"], console)
    else:
        console.print(f"no projection on {PROJECTED_TP} GPUs: {report.projection}",
                      highlight=False)


def print_projection(p: Projection, model: str, console: Console) -> None:
    table = Table(title=f"PROJECTION, not a measurement: {model} per token on {p.tp} GPUs "
                        f"(tp {p.tp}), from the layers above", title_justify="left")
    for name in ("part", "count", "measured ms (1 GPU)", "bytes (1 GPU)", "bytes per rank",
                 "all-reduces", "projected ms", "if the excess is fixed"):
        table.add_column(name, justify="left" if name == "part" else "right")
    for part in p.parts:
        table.add_row(part.name, str(part.count), f"{part.measured_ms:.4f}",
                      human_bytes(part.bytes_tp1), human_bytes(part.bytes_rank),
                      f"{part.allreduces:g}", f"{part.projected_ms:.4f}",
                      f"{part.excess_fixed_ms:.4f}")
    bound = p.excess_fixed_total_ms
    table.add_row("projected total", "", "", "", "", "",
                  f"{p.total_ms:.3f} ({1e3 / p.total_ms:.0f} tokens/s)",
                  f"{bound:.3f} ({1e3 / bound:.0f} tokens/s)", style="bold")
    for pub in p.published:
        table.add_row(f"published: {pub.what}", "", "", "", "", "",
                      f"{pub.ms_per_token:.3f} ({pub.tokens_per_s:.0f} tokens/s)", "", style="dim")
    console.print(table)
    console.print(f"projection: each all-reduce an assumed {p.allreduce_us:g} µs "
                  "(--allreduce-us); fixed costs per op from the cost model, the rest of each "
                  "part's measured time scaled by the bytes one rank reads; 'if the excess is "
                  "fixed': a bound, all of a part's measured time above its roofline fixed",
                  highlight=False)
    if not p.published:
        console.print("TileRT's published figures: not found for this model", highlight=False)
    for pub in p.published:
        console.print(f"{pub.what}: {pub.how_read}; {pub.source}", highlight=False)


# -- the run --------------------------------------------------------------------------------------
def check_per_layer(config: BenchConfig) -> None:
    """What --per-layer cannot do, refused before any work."""
    if (Path(config.model) / "manifest.json").is_file():
        raise BenchError("--per-layer compiles variants of the model: give a model name or "
                         "config.json, not an artifact directory")
    for bad, why in ((len(config.points) != 1, "one point (--context, --gen), not --points"),
                     (config.systems != ("tilertc",), "tilertc only: the baselines do not run "
                                                      "the variants (leave out --systems)"),
                     (config.weights is not None, "random weights only: the variants' "
                                                  "vocabulary differs from a checkpoint's"),
                     (bool(config.artifacts), "no --artifact: the variants are compiled here"),
                     (config.profile, "no --profile"), (config.tp != 1, "one GPU (--tp 1)"),
                     (len(config.backends) != 1, "one backend")):
        if bad:
            raise BenchError(f"--per-layer times {why}")


def projection_costs(plan: list[tuple[str, int]], spec_of: Callable[..., ModelSpec],
                     kv_context: int) -> dict[str, KindCosts] | str:
    """Per kind (kind, N) its `KindCosts`, or why the model has no tp-8 program."""
    try:
        return {kind: kind_costs(lambda *a, kind=kind: spec_of(kind, *a), n, kv_context)
                for kind, n in plan}
    except ScheduleError as e:
        return str(e)


def run_per_layer(config: BenchConfig, layers_timed: int | None = None,
                  allreduce_us: float = ALLREDUCE_US,
                  phase: Phase = quiet_phase) -> PerLayerReport:
    """Time every layer kind of the model (two bench runs each) and project the whole model."""
    check_per_layer(config)
    spec = check_model(config)
    require_gpu(config.device)
    (context, gen), = config.points
    kv_context = context + gen // 2  # as `token_bytes` and the bench's prediction count it
    kinds = layer_kinds(spec)
    budget = GPU_MEMORY_SHARE * free_bytes(config.device)  # a GPU: never None

    def spec_of(kind: str, layers: int, small_vocab: bool = True) -> ModelSpec:
        return variant_spec(config, spec, kind, layers, small_vocab)

    def need(kind: str, n: int) -> int:
        return device_weight_bytes(spec_of(kind, 1 + n), capacity_for(config.points))

    plan = [(kind, layers_to_time(lambda n, kind=kind: need(kind, n), budget, layers_timed,
                                  f"{spec.name} {kind} layers ({spec.weight_format.dtype})"))
            for kind in kinds]
    with phase(f"the cost model's programs of the variants, tp 1 and tp {PROJECTED_TP}"):
        costs = projection_costs(plan, spec_of, kv_context)
    timings, runs = [], {}
    for kind, n in plan:
        measured = []
        for layers in (1, 1 + n):
            name = f"{kind}-{layers}"
            run_config = dataclasses.replace(
                config, out=config.out / name,
                overrides=variant_overrides(config, spec, kind, layers))

            def labelled(text: str, what: str = f"{layers} {kind} layer(s)") -> Any:
                return phase(f"{spec.name}, {what}: {text}")

            runs[name], _ = run_bench(run_config, labelled)
            measured.append(VariantRun.from_report(layers, runs[name]))
        timings.append(layer_timing(kind, kinds[kind], *measured))
    first = next(iter(runs.values()))
    return PerLayerReport(
        model={"name": spec.name, "spec_hash": spec.content_hash()}, context=context, gen=gen,
        vocab_size=min(spec.vocab_size, LAYER_VOCAB), weights=first.weights, timings=timings,
        projection=(costs if isinstance(costs, str)
                    else project(timings, costs, allreduce_us, spec.name)),
        runs=runs, command=config.command,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"))


def finish_per_layer(report: PerLayerReport, out: Path, console: Console) -> list[Path]:
    """Show the tables and write bench.json; returns the files written."""
    print_per_layer(report, console)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench.json"
    path.write_text(json.dumps(report.to_dict(), indent=1) + "\n")
    return [path]
