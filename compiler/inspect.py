"""What one decode step reads: the op graph with bytes per op, and the bandwidth floor it implies.

At batch 1 every token streams the weights (and the KV cache) from HBM once, so the bytes a step
reads, divided by the target's bandwidth, is the latency no kernel can beat. This module counts
those bytes from the graph; `tilertc inspect` renders the result.

Counting rules (each tensor is counted once, at the op that reads most of it):
- an embedding table is read one row per token (a tied table is also read in full by lm_head);
- the `moe_experts` op reads top_k of its num_experts experts' weights (which ones changes
  from token to token; the bytes do not); shared experts and the router are read in full;
- a KV cache is read up to the context length, or only the DSA indexer's top-k rows by an op
  that takes the indexer's selection (`dsa_topk` output) as an input.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from tilertc.ir.build import build_graph
from tilertc.ir.graph import Graph, Op, Tensor, TensorKind
from tilertc.ir.target import Target
from tilertc.layer_runs import layer_runs, rename
from tilertc.model_specs.spec import ModelSpec


@dataclass
class OpRow:
    """One op, or in a summary one op of a run of identical layers (`count` of them)."""

    name: str
    opcode: str
    outputs: list[tuple[str, tuple[int, ...], str]]  # (tensor, shape, dtype)
    weight_bytes: int  # weight bytes this op reads per token
    kv_bytes: int  # KV-cache bytes this op reads per token at the context length
    layers: tuple[int, int] | None = None  # first and last layer folded into this row
    count: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "opcode": self.opcode,
            "outputs": [{"name": n, "shape": list(s), "dtype": d} for n, s, d in self.outputs],
            "weight_bytes_per_token": self.weight_bytes,
            "kv_bytes_per_token": self.kv_bytes,
            "layers": list(self.layers) if self.layers else None,
            "count": self.count,
        }


@dataclass
class Inspection:
    spec: ModelSpec
    target: Target
    context: int
    rows: list[OpRow]
    totals: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec.to_dict(),
            "target": self.target.name,
            "context": self.context,
            "ops": [r.to_dict() for r in self.rows],
            "totals": self.totals,
        }


def inspect_model(spec: ModelSpec, target: Target, max_seq_len: int | None = None,
                  summary: bool = False) -> Inspection:
    """Build the decode graph of `spec` and count what one token at full context reads."""
    g = build_graph(spec, max_seq_len)
    context = g.attrs["max_seq_len"]
    charged = charge_reads(g, context)
    rows = [OpRow(op.name, op.opcode,
                  [(t, g.tensors[t].shape, g.tensors[t].dtype) for t in op.outputs],
                  charged[op.name][TensorKind.WEIGHT], charged[op.name][TensorKind.KV_CACHE],
                  (op.layer, op.layer) if op.layer is not None else None)
            for op in g.ops()]
    weights = sum(r.weight_bytes for r in rows)
    kv = sum(r.kv_bytes for r in rows)
    floor = target.bandwidth_floor_s(weights + kv)
    totals: dict[str, Any] = {
        "weight_bytes_per_token": weights,
        "weight_bytes_stored": g.weight_bytes(),
        "kv_bytes_per_token": kv,
        "kv_cache_bytes": sum(t.nbytes for t in g.tensors.values()
                              if t.kind is TensorKind.KV_CACHE),
        "bytes_per_token": weights + kv,
        "bandwidth_bytes_per_s": target.hbm_bandwidth,
        "floor_s_per_token": floor,
        "max_tokens_per_s": 1.0 / floor,
        "weights_only_floor_s_per_token": target.bandwidth_floor_s(weights),
        "num_ops": len(rows),
    }
    if spec.moe is not None:
        totals["moe_routed_experts_read_per_token"] = spec.moe.experts_per_token
        totals["moe_routed_experts"] = spec.moe.num_experts
        totals["moe_shared_experts"] = spec.moe.num_shared_experts
    return Inspection(spec, target, context, fold_layers(rows) if summary else rows, totals)


def read_fraction(g: Graph, op: Op, t: Tensor, context: int) -> float:
    """The fraction of tensor `t` that `op` reads for one token."""
    if t.kind is TensorKind.KV_CACHE:
        picks = [p.attrs["topk"] for p in g.producers(op.name) if p.opcode == "dsa_topk"]
        return min([context, *picks]) / t.shape[0]
    if op.opcode == "embedding":
        return 1 / t.shape[0]
    if op.opcode == "moe_experts":
        return op.attrs["top_k"] / op.attrs["num_experts"]
    return 1.0


def charge_reads(g: Graph, context: int) -> dict[str, dict[TensorKind, int]]:
    """Bytes per token of weights and KV cache charged to each op.

    A tensor read by several ops (a tied embedding, a weight split between two ops) is charged
    once, to the first op that reads the largest part of it, so that the ops' bytes add up to
    the step's traffic.
    """
    best: dict[str, tuple[float, str]] = {}
    for op in g.ops():
        for name in dict.fromkeys(op.inputs):
            t = g.tensors[name]
            if t.kind in (TensorKind.WEIGHT, TensorKind.KV_CACHE):
                frac = read_fraction(g, op, t, context)
                if name not in best or frac > best[name][0]:
                    best[name] = (frac, op.name)
    charged = {op.name: dict.fromkeys((TensorKind.WEIGHT, TensorKind.KV_CACHE), 0)
               for op in g.ops()}
    for name, (frac, op_name) in best.items():
        t = g.tensors[name]
        charged[op_name][t.kind] += round(t.nbytes * frac)
    return charged


def fold_layers(rows: list[OpRow]) -> list[OpRow]:
    """Fold runs of consecutive layers whose ops are identical into one row per op, ×count."""
    return [r for run in layer_runs(rows, structure) for r in fold_run(run)]


def fold_run(run: list[list[OpRow]]) -> list[OpRow]:
    """The rows of the first layer of `run`, standing for all of them."""
    if len(run) == 1:
        return run[0]
    first, last = run[0][0].layers[0], run[-1][0].layers[0]
    return [OpRow(layer_pattern(r, f"{first}-{last}"), r.opcode, r.outputs, r.weight_bytes,
                  r.kv_bytes, (first, last), len(run)) for r in run[0]]


def layer_pattern(r: OpRow, layers: str) -> str:
    """`layers.3.q_proj` -> `layers.{layers}.q_proj`."""
    return rename(r.name, r.layers[0], layers)


def structure(layer: list[OpRow]) -> list[tuple]:
    """What must match for two layers to fold: everything but the layer index."""
    return [(layer_pattern(r, "*"), r.opcode, [(s, d) for _, s, d in r.outputs],
             r.weight_bytes, r.kv_bytes) for r in layer]


# -- rendering ---------------------------------------------------------------------------------

def human_bytes(n: float) -> str:
    """Decimal units (GB = 1e9 bytes), as bandwidths are quoted."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def human_seconds(s: float) -> str:
    return f"{s * 1e3:.4g} ms" if s >= 1e-3 else f"{s * 1e6:.4g} µs"


def print_inspection(insp: Inspection, console: Console) -> None:
    """The op table, then the totals and the bandwidth floor."""
    folded = any(r.count > 1 for r in insp.rows)
    table = Table(title=f"{insp.spec.name}: one decode step ({len(insp.rows)} rows)",
                  title_justify="left")
    table.add_column("op", no_wrap=True)
    table.add_column("opcode")
    table.add_column("output", overflow="fold")
    table.add_column("weights/token", justify="right")
    table.add_column("KV/token", justify="right")
    if folded:
        table.add_column("×", justify="right")
    for r in insp.rows:
        out = ", ".join(f"{'×'.join(map(str, s))} {d}" for _, s, d in r.outputs)
        cells = [r.name, r.opcode, out, human_bytes(r.weight_bytes) if r.weight_bytes else "",
                 human_bytes(r.kv_bytes) if r.kv_bytes else ""]
        table.add_row(*cells, *([str(r.count)] if folded else []))
    console.print(table)
    t = insp.totals
    lines = [
        f"weights read per token:   {human_bytes(t['weight_bytes_per_token'])} "
        f"({t['weight_bytes_per_token']} bytes; stored {human_bytes(t['weight_bytes_stored'])})",
        f"KV cache read per token:  {human_bytes(t['kv_bytes_per_token'])} "
        f"at context {insp.context} (cache {human_bytes(t['kv_cache_bytes'])})",
        f"bandwidth floor on {insp.target.name} "
        f"({human_bytes(t['bandwidth_bytes_per_s'])}/s): "
        f"{human_seconds(t['floor_s_per_token'])}/token, at most "
        f"{t['max_tokens_per_s']:.0f} tokens/s "
        f"(weights alone: {human_seconds(t['weights_only_floor_s_per_token'])})",
    ]
    if "moe_routed_experts" in t:
        lines.append(f"MoE: counts the {t['moe_routed_experts_read_per_token']} of "
                     f"{t['moe_routed_experts']} routed experts a token reads, plus "
                     f"{t['moe_shared_experts']} shared; all experts are stored")
    for line in lines:
        console.print(line, highlight=False, soft_wrap=True)
