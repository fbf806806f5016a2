"""`tilertc explain`: the schedule's decisions per fused op, and what the cost model predicts.

For every fused op: its tile (and whether its FP8 weights run on the tensor cores), how many
tasks and SMs it uses, how deep the weight pipeline is for it (ring pages per task), where each
tensor it touches lives, the roles (warps per CTA, and under tensor parallelism how the op is
split across ranks) and its predicted time. Then the predicted per-token latency, tokens/s per
user and the share of the bandwidth roofline, and every line of `Program.decisions`. Runs of
identical layers fold into one row ×N, as in `tilertc inspect --summary`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from tilertc.inspect import human_bytes, human_seconds
from tilertc.ir.graph import TensorKind
from tilertc.ir.target import Target
from tilertc.layer_runs import layer_runs, rename
from tilertc.model_specs.spec import ModelSpec
from tilertc.passes.cost import op_times_ns, roofline_ns, step_ns
from tilertc.passes.pipeline import make_program
from tilertc.passes.program import Program
from tilertc.passes.sharding import ends_in_allreduce
from tilertc.passes.tiling import is_tiled


@dataclass
class OpRow:
    """One fused op, or in a folded run one op standing for `count` identical layers."""

    name: str
    opcode: str
    tile: str
    tasks: int
    sms: int
    ring_pages: int  # pages of the weight ring one task streams (at most)
    residency: dict[str, str]  # tensor -> where it lives
    roles: str
    predicted_ns: float  # one instance (the mean over a folded run)
    bytes: int  # weights and KV/activation reads of one instance
    layers: tuple[int, int] | None = None
    count: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "opcode": self.opcode, "tile": self.tile,
                "tasks": self.tasks, "sms": self.sms, "ring_pages_per_task": self.ring_pages,
                "residency": self.residency, "roles": self.roles,
                "predicted_ns": self.predicted_ns, "bytes": self.bytes,
                "layers": list(self.layers) if self.layers else None, "count": self.count}


@dataclass
class Explanation:
    spec: ModelSpec
    target: Target
    tp: int
    rows: list[OpRow]
    totals: dict[str, Any] = field(default_factory=dict)
    decisions: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.spec.name, "target": self.target.name, "tp": self.tp,
                "ops": [r.to_dict() for r in self.rows], "totals": self.totals,
                "decisions": self.decisions}


def residency(program: Program, tensor: str) -> str:
    """Where one tensor lives in the schedule."""
    g = program.graph
    t = g.tensors[tensor]
    if t.kind is TensorKind.WEIGHT and len(t.shape) > 1:
        if ".mlp.experts." in (t.hf_name or ""):
            return "HBM, expert region, streamed through the smem ring by expert id"
        return "HBM, packed in stream order, streamed through the smem ring"
    b = program.buffers.get(tensor)
    if b is None:
        if t.kind is TensorKind.OUTPUT:
            return "device token list, copied to a host-mapped ring"
        return "host input" if t.kind is TensorKind.INPUT else "not materialized"
    if b.arena == "kv":
        return f"HBM, {b.dtype} KV arena @{b.offset}"
    return f"L2-resident {b.dtype}, act arena @{b.offset}"


def tp_role(program: Program, op) -> str:
    """How an op is split across ranks, from its weights' shard records."""
    if program.tp == 1:
        return ""
    g = program.graph
    axes = {g.tensors[w].attrs["shard"]["axis"] for w in op.inputs
            if g.tensors[w].kind is TensorKind.WEIGHT and "shard" in g.tensors[w].attrs}
    if op.opcode in ("moe_gate_up", "moe_down_add"):
        role = "expert-parallel"
    elif axes == {1}:
        role = "row-parallel"
    elif axes:
        role = "column-parallel"
    elif op.opcode in ("attention", "mla_attention"):
        role = "heads split"
    else:
        role = "replicated"
    return role + (" + all-reduce" if ends_in_allreduce(program, op) else "")


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("s" if n != 1 else "")


def _tile_text(program: Program, op) -> str:
    """The op's tile, and ", FP8 tiles" where its weights run on the tensor cores."""
    return _tile_shape(op) + (", FP8 tiles" if is_tiled(program, op) else "")


def _tile_shape(op) -> str:
    tile = op.attrs["tile"]
    if "busy" in tile:
        a = op.attrs
        if op.opcode == "moe_down_add":
            return f"{a['rows']} rows x {a['slots']} slots"
        lo, hi = tile["rows_per_task"]
        return (f"{a['slots']} slots x {a['intermediate_size']} rows, "
                f"{lo if lo == hi else f'{lo}-{hi}'} a task")
    if "rows_per_task" in tile:
        lo, hi = tile["rows_per_task"]
        return f"{lo}-{hi} rows" if lo != hi else _count(lo, "row")
    if "chunks" in tile:
        return (f"{_count(tile['tasks'] // tile['chunks'], 'group')} of "
                f"{_count(tile['heads_per_task'], 'head')}"
                f" x {_count(tile['chunks'], 'chunk')}")
    if "context_chunks" in tile:
        return f"{tile['context_chunks']} context chunks"
    return "whole op"


def explain_program(program: Program, fold: bool = True) -> Explanation:
    """The explanation of an already scheduled program."""
    g, cfg = program.graph, program.config
    times = op_times_ns(program)
    by_op: dict[str, list] = {}
    for t in program.tasks:
        by_op.setdefault(t.op, []).append(t)
    warps = f"1 loader + {cfg['compute_warps']} compute warps"
    rows = []
    for op in g.ops():
        tasks = by_op[op.name]
        biggest = max(t.weight_bytes for t in tasks)
        tensors = dict.fromkeys(t for t in (*op.inputs, *op.outputs) if t in g.tensors)
        role = tp_role(program, op)
        rows.append(OpRow(op.name, op.opcode, _tile_text(program, op), len(tasks),
                          len({t.sm for t in tasks}), -(-biggest // cfg["page_bytes"]),
                          {t: residency(program, t) for t in tensors},
                          warps + (f"; {role}" if role else ""), times[op.name],
                          sum(t.weight_bytes + t.other_bytes for t in tasks),
                          (op.layer, op.layer) if op.layer is not None else None))
    step, roof = step_ns(program), roofline_ns(program)
    totals = {"step_ns": step, "tokens_per_s": 1e9 / step, "roofline_ns": roof,
              "roofline_fraction": roof / step, "bytes_per_token": sum(r.bytes for r in rows),
              "fused_ops": len(rows), "tasks": len(program.tasks),
              "allreduces": len(cfg.get("sharding", {}).get("allreduce_after", ())),
              "ring_pages": cfg["ring_pages"], "page_bytes": cfg["page_bytes"]}
    return Explanation(program.spec, program.target, program.tp,
                       fold_layers(rows) if fold else rows, totals, list(program.decisions))


def explain(spec: ModelSpec, target: str | Target = "h200", tp: int = 1,
            max_seq_len: int | None = None, fold: bool = True) -> Explanation:
    """Schedule `spec` and explain every decision (folding identical layers)."""
    return explain_program(make_program(spec, target, tp, max_seq_len), fold)


# -- folding identical layers -------------------------------------------------------------------

def _structure(layer: list[OpRow]) -> list[tuple]:
    """What must match for two layers to fold: all but names, offsets, times and SMs."""
    return [(rename(r.name, r.layers[0], "*"), r.opcode, r.tile, r.tasks, r.ring_pages,
             r.roles, r.bytes) for r in layer]


def fold_layers(rows: list[OpRow]) -> list[OpRow]:
    """Runs of consecutive layers with the same structure become one row per op, ×count,
    with the mean predicted time."""
    return [r for run in layer_runs(rows, _structure) for r in _fold_run(run)]


def _fold_run(run: list[list[OpRow]]) -> list[OpRow]:
    if len(run) == 1:
        return run[0]
    first, last = run[0][0].layers[0], run[-1][0].layers[0]
    span = f"{first}-{last}"
    out = []
    for k, r in enumerate(run[0]):
        mean = sum(seg[k].predicted_ns for seg in run) / len(run)
        places = {rename(t, first, span): where.split(" @")[0] for t, where in r.residency.items()}
        out.append(OpRow(rename(r.name, first, span), r.opcode, r.tile, r.tasks,
                         max(seg[k].sms for seg in run), r.ring_pages, places, r.roles,
                         mean, r.bytes, (first, last), len(run)))
    return out


# -- rendering ---------------------------------------------------------------------------------

def print_explanation(ex: Explanation, console: Console) -> None:
    table = Table(title=f"{ex.spec.name} on {ex.target.name}, tp {ex.tp}: the schedule per "
                  "fused op", title_justify="left")
    for col, just in (("op", "left"), ("opcode", "left"), ("×", "right"), ("tile", "left"),
                      ("tasks", "right"), ("SMs", "right"), ("pages/task", "right"),
                      ("bytes", "right"), ("predicted", "right"), ("roles", "left")):
        table.add_column(col, justify=just, no_wrap=col == "op")
    for r in ex.rows:
        table.add_row(r.name, r.opcode, str(r.count), r.tile, str(r.tasks), str(r.sms),
                      str(r.ring_pages), human_bytes(r.bytes),
                      human_seconds(r.predicted_ns * 1e-9), r.roles)
    console.print(table)
    places: dict[str, str] = {}
    for r in ex.rows:
        places.update(r.residency)
    res = Table(title="residency", title_justify="left")
    res.add_column("tensor", no_wrap=True)
    res.add_column("lives in")
    for tensor, where in places.items():
        res.add_row(tensor, where)
    console.print(res)
    t = ex.totals
    for line in (
        f"predicted: {human_seconds(t['step_ns'] * 1e-9)}/token, "
        f"{t['tokens_per_s']:.1f} tokens/s/user, {t['roofline_fraction'] * 100:.1f}% of the "
        f"bandwidth roofline ({human_seconds(t['roofline_ns'] * 1e-9)}/token for "
        f"{human_bytes(t['bytes_per_token'])} at {human_bytes(ex.target.hbm_bandwidth)}/s)",
        f"{t['fused_ops']} fused ops, {t['tasks']} tasks, weight ring {t['ring_pages']} x "
        f"{t['page_bytes'] // 1024} KB per SM" + (f", {t['allreduces']} all-reduces per token"
                                                  if ex.tp > 1 else ""),
        "decisions:",
    ):
        console.print(line, highlight=False, soft_wrap=True)
    for d in ex.decisions:
        console.print(f"  {d}", highlight=False, soft_wrap=True, markup=False)
