"""Sharding: what each GPU rank holds and computes under tensor parallelism (`--tp N`).

Decides the shard of every op for tp > 1, Megatron-style, so that each block needs a single
all-reduce:
- attention is split by heads: q/k/v (and MLA's q_b and kv_b) projections are column-parallel
  (each rank computes its heads' rows), o_proj is row-parallel (each rank reads its heads'
  slice of the input) and leaves a partial sum; when there are fewer KV heads than ranks, each
  KV head is replicated on tp / n_kv_heads ranks;
- the dense MLP and the shared expert are split the same way: gate/up column-parallel,
  down_proj row-parallel;
- routed experts are split across ranks (expert parallelism): rank r holds experts
  [r·E/tp, (r+1)·E/tp); the router runs on every rank, each rank runs the chosen experts it
  holds (up to min(top_k, E/tp) slots, k/tp expected) and leaves a partial sum;
- the partial sums meet in one all-reduce before each residual add (after o_proj, after
  down_proj or after the MoE output);
- lm_head is split by vocabulary rows; the argmax exchanges each rank's (max, index) pair;
- everything small or shared by all heads is replicated: embedding, norms, MLA's q_a/kv_a
  latent projections and cache, the DSA indexer, the router.

FP8 weights are cut with their block scales: a cut must fall on a block boundary of the scale
grid (column-parallel: each rank's rows a whole number of block rows; row-parallel: its input
columns a whole number of block columns; experts are whole), so that each rank's weight is an
FP8 weight of its own with the matching part of `weight_scale_inv` (the manifest records the
scales' cut like the weight's); a cut inside a block is refused, naming the weight.

The per-rank program is the same schedule over the shard's dimensions: this pass rewrites the
decode graph's shapes and attrs to rank 0's shard (every rank's has the same shape), so the
passes after it only ever see one rank. It runs first, on the unfused graph, where each op
still says what it is. tp = 1 leaves the graph as it is.
"""

from __future__ import annotations

import dataclasses

from tilertc.ir.graph import Op
from tilertc.passes.program import Program, ScheduleError

COLUMN = ("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


# A sharded weight's attrs["shard"]: the axis it is cut along, tp, and into how many distinct
# parts (tp, or fewer when KV heads are replicated over ranks: rank r holds part r * parts // tp).


def weight_rule(hf_name: str) -> str:
    """How a weight is split: "column" (output rows), "row" (input columns), "expert"
    (whole experts per rank) or "replicated"."""
    if ".mlp.experts." in hf_name:
        return "expert"
    if hf_name == "lm_head.weight":
        return "column"
    module = hf_name.rsplit(".", 2)[-2] if hf_name.endswith(".weight") else ""
    if module in COLUMN:
        return "column"
    if module in ROW:
        return "row"
    return "replicated"


class Sharder:
    """Rewrites one graph to rank 0's shard, op by op in program order."""

    def __init__(self, program: Program) -> None:
        self.program, self.g, self.tp = program, program.graph, program.tp
        self.partial: set[str] = set()  # activations holding a per-rank partial sum
        self.allreduce_after: list[str] = []
        self.kv_replication = 1

    def fail(self, op: Op, what: str, n: int) -> ScheduleError:
        return ScheduleError(f"--tp {self.tp}: {what} {n} is not divisible by {self.tp} "
                             f"(op {op.name!r})")

    def split(self, op: Op, what: str, n: int) -> int:
        if n % self.tp:
            raise self.fail(op, what, n)
        return n // self.tp

    def resize(self, name: str, shape: tuple[int, ...], **attrs: object) -> None:
        t = self.g.tensors[name]
        self.g.tensors[name] = dataclasses.replace(t, shape=shape, attrs={**t.attrs, **attrs})

    def cut_weight(self, op: Op, name: str, shape: tuple[int, int], axis: int,
                   parts: int) -> None:
        """Cuts weight `name` to rank 0's `shape` along `axis` (`parts` distinct parts), and an
        FP8 weight's scale grid with it, block for block."""
        shard = {"axis": axis, "tp": self.tp, "parts": parts}
        t = self.g.tensors[name]
        if "scale_inv" in t.attrs:
            block = t.attrs["block"][axis]
            if shape[axis] % block:
                what = ("output rows", "input columns")[axis]
                raise ScheduleError(
                    f"--tp {self.tp}: FP8 weight {t.hf_name!r} (op {op.name!r}): "
                    f"{shape[axis]} {what} per rank is not a whole number of its "
                    f"{block}-{what.split()[1][:-1]} scale blocks; each rank's part must be "
                    "cut on a block boundary of weight_scale_inv (or use bf16 weights: "
                    "--weight-dtype bf16)")
            scale = self.g.tensors[t.attrs["scale_inv"]]
            grid = list(scale.shape)
            grid[axis] = shape[axis] // block
            self.resize(scale.name, tuple(grid), shard=shard)
        self.resize(name, shape, shard=shard)

    def heads(self, name: str, head_dim: int) -> int:
        return self.g.tensors[name].numel // head_dim

    def kv_heads(self, op: Op, n_kv: int, n_heads: int) -> int:
        """KV heads per rank: a 1/tp share, or one replicated head when tp is a multiple."""
        if n_kv % self.tp == 0:
            return n_kv // self.tp
        if self.tp % n_kv == 0 and n_heads % self.tp == 0:
            self.kv_replication = self.tp // n_kv
            return 1
        raise ScheduleError(f"--tp {self.tp}: {n_kv} KV heads can neither be split over nor "
                            f"replicated on {self.tp} ranks (op {op.name!r})")

    def linear(self, op: Op) -> None:
        w = op.inputs[1]
        rule = "column" if op.name == "lm_head" else weight_rule(self.g.tensors[w].hf_name)
        if rule == "column" and any(w in o.inputs for o in self.g.ops() if o is not op):
            w = self.own_copy(op, w)  # a tied lm_head: the embedding keeps the whole table
        rows, k = self.g.tensors[w].shape
        out = op.outputs[0]
        if rule == "column":
            per_rank = self.column_rows(op, w, rows)
            self.cut_weight(op, w, (per_rank, k), 0, rows // per_rank)
            self.resize(out, (per_rank,))
        elif rule == "row":
            self.cut_weight(op, w, (rows, self.split(op, "input width", k)), 1, self.tp)
            self.partial.add(out)
        scale = self.g.tensors[w].attrs.get("scale_inv")  # an FP8 weight's: cut with it
        for bias in (b for b in op.inputs[2:] if b != scale and rule == "column"):
            self.resize(bias, (self.g.tensors[out].numel,))  # a bias follows its rows

    def own_copy(self, op: Op, w: str) -> str:
        name = f"{op.name}.weight_shard"
        self.g.tensors[name] = dataclasses.replace(self.g.tensors[w], name=name)
        op.inputs = (op.inputs[0], name, *op.inputs[2:])
        return name

    def column_rows(self, op: Op, w: str, rows: int) -> int:
        spec = self.program.spec
        suffix = self.g.tensors[w].hf_name.rsplit(".", 2)[-2]
        if suffix in ("k_proj", "v_proj"):
            return rows // spec.num_kv_heads * self.kv_heads(op, spec.num_kv_heads, spec.num_heads)
        if suffix in ("q_proj", "q_b_proj", "kv_b_proj"):
            return rows // spec.num_heads * self.split(op, "number of attention heads",
                                                       spec.num_heads)
        what = "vocabulary size" if op.name == "lm_head" else "intermediate size"
        return self.split(op, what, rows)

    def run(self) -> None:
        for op in self.g.ops():
            a = op.attrs
            if op.opcode == "linear":
                self.linear(op)
            elif op.opcode in ("head_rms_norm", "rope"):
                a["n_heads"] = self.heads(op.inputs[0], a["head_dim"])
                self.resize(op.outputs[0], self.g.tensors[op.inputs[0]].shape)
            elif op.opcode == "silu_mul":
                self.resize(op.outputs[0], self.g.tensors[op.inputs[0]].shape)
            elif op.opcode == "kv_append":
                for src, cache in zip(op.inputs[:-1], op.outputs, strict=True):
                    c = self.g.tensors[cache]
                    if len(c.shape) == 3:  # GQA: [seq, kv heads, head dim]
                        self.resize(cache, (c.shape[0], self.heads(src, c.shape[2]), c.shape[2]))
            elif op.opcode == "attention":
                a["n_heads"] = self.heads(op.inputs[0], a["head_dim"])
                a["n_kv_heads"] = self.g.tensors[op.inputs[1]].shape[1]
                self.resize(op.outputs[0], self.g.tensors[op.inputs[0]].shape)
            elif op.opcode in ("mla_absorb_q", "mla_attention", "mla_expand_v"):
                self.mla(op)
            elif op.opcode == "moe_experts":
                self.experts(op)
            elif op.opcode == "add":
                self.add(op)
            elif op.opcode == "argmax":
                a["reduce_over_ranks"] = True

    def mla(self, op: Op) -> None:
        a = op.attrs
        if op.opcode != "mla_attention":  # kv_b_proj: whole heads' rows, column-parallel
            kv_b = self.g.tensors[op.inputs[1]]
            if "shard" not in kv_b.attrs:
                rows = kv_b.shape[0] // a["n_heads"] * self.split(op, "number of attention heads",
                                                                  a["n_heads"])
                self.cut_weight(op, kv_b.name, (rows, kv_b.shape[1]), 0, self.tp)
        a["n_heads"] = self.split(op, "number of attention heads", a["n_heads"])
        per_head = {"mla_absorb_q": a["kv_lora_rank"], "mla_attention": a["kv_lora_rank"],
                    "mla_expand_v": a["v_head_dim"]}[op.opcode]
        self.resize(op.outputs[0], (a["n_heads"] * per_head,))

    def experts(self, op: Op) -> None:
        a = op.attrs
        local = self.split(op, "number of routed experts", a["num_experts"])
        per_expert = (len(op.inputs) - 3) // a["num_experts"]
        keep = op.inputs[3:3 + local * per_expert]
        for name in op.inputs[3 + local * per_expert:]:
            del self.g.tensors[name]  # other ranks' experts (FP8: and their scales)
        op.inputs = (*op.inputs[:3], *keep)
        shard = {"local_experts": [0, local], "slots": min(a["top_k"], local)}
        a.update(shard)
        # the router writes the shard's view of its choices (task_semantics_moe: local_routes)
        router = next(p for p in self.g.producers(op.name) if op.inputs[1] in p.outputs)
        router.attrs.update(shard)
        self.partial.add(op.outputs[0])

    def add(self, op: Op) -> None:
        partial = [t for t in op.inputs if t in self.partial]
        if len(partial) == len(op.inputs):  # partial + partial stays partial (MoE combine)
            self.partial.add(op.outputs[0])
        elif partial:  # the residual add: the partial sum is all-reduced first
            producer = next(p for p in self.g.producers(op.name) if partial[0] in p.outputs)
            self.allreduce_after.append(producer.name)


EXCHANGE_OPCODES = ("matvec_add", "moe_down_add")


def ends_in_allreduce(program: Program, op: Op) -> bool:
    """Whether fused `op` all-reduces its output across the ranks: a residual add fused with a
    per-rank partial sum (`allreduce_after`). A MoE block's gate/up is fused from the same
    experts op as its down projection, but only the down projection adds the residual."""
    after = program.config.get("sharding", {}).get("allreduce_after", ())
    return (program.tp > 1 and op.opcode in EXCHANGE_OPCODES
            and bool(set(after) & set(op.attrs.get("fused_from", ()))))


def exchange_ops(program: Program) -> list[Op]:
    """The fused ops that end in an all-reduce: the residual adds whose other input is a
    per-rank partial sum (`allreduce_after`), fused with that sum's producer. Each such op's
    tasks exchange their partial rows with the other ranks before adding the residual
    (passes/synchronization.py)."""
    after = set(program.config.get("sharding", {}).get("allreduce_after", ()))
    if program.tp == 1 or not after:
        return []
    ops = [op for op in program.graph.ops() if ends_in_allreduce(program, op)]
    covered = {name for op in ops for name in op.attrs["fused_from"]} & after
    if covered != after:
        raise ScheduleError(f"--tp {program.tp}: the all-reduce after "
                            f"{sorted(after - covered)[0]!r} is not fused into a residual add "
                            f"({' or '.join(EXCHANGE_OPCODES)})")
    return ops


def shard(program: Program) -> Program:
    tp = program.tp
    if tp < 1:
        raise ScheduleError(f"--tp {tp}: the number of GPU ranks must be at least 1")
    if tp == 1:
        program.config["sharding"] = {"tp": 1, "allreduce_after": []}
        program.decide("sharding", "tp 1: one GPU holds the whole model")
        return program
    s = Sharder(program)
    s.run()
    spec = program.spec
    plan = {"tp": tp, "allreduce_after": s.allreduce_after,
            "heads_per_rank": spec.num_heads // tp, "kv_replication": s.kv_replication}
    lines = [f"tp {tp}: each rank runs the same program on its shard; "
             f"{spec.num_heads // tp} attention heads per rank"]
    if spec.mla is None:
        kv = max(1, spec.num_kv_heads // tp)
        plan["kv_heads_per_rank"] = kv
        lines.append(f"{kv} KV head(s) per rank" + (
            f", each replicated on {s.kv_replication} ranks" if s.kv_replication > 1 else ""))
    else:
        lines.append("MLA latent projections, latent cache and the DSA indexer replicated")
    if spec.moe is not None:
        local = spec.moe.num_experts // tp
        plan["experts_per_rank"] = local
        lines.append(f"{local} routed experts per rank (experts [r*{local}, (r+1)*{local}) "
                     f"on rank r), up to {min(spec.moe.experts_per_token, local)} of a token's "
                     f"{spec.moe.experts_per_token} on one rank, "
                     f"{spec.moe.experts_per_token / tp:g} expected")
    lines.append("MLP/shared expert: gate/up column-parallel, down_proj row-parallel; "
                 "lm_head split by vocabulary rows, argmax over ranks' (max, index) pairs")
    lines.append(f"{len(s.allreduce_after)} all-reduces per token (one before each residual "
                 "add)")
    program.config["sharding"] = plan
    for line in lines:
        program.decide("sharding", line)
    return program

