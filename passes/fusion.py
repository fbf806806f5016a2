"""Fusion: fold elementwise work into the matrix-vector products and attention around it.

Decides which ops become one kernel instruction. At batch 1 every op boundary costs a
synchronization and a round trip of the activation through L2, while elementwise work is free
next to the weight stream, so everything elementwise is folded into a neighbour:

- `rms_norm` + the `linear`s that read it            -> `norm_matvec` (q/k/v become one op,
  MLA's q_a/kv_a and the DSA indexer's key and head weights too: one output, the
  concatenation of theirs, whose parts stay addressable as views; one op per weight format
  where an FP8 model keeps one of them bf16, as the DSA indexer's head weights);
  with `silu_mul` over a gate/up pair                 -> `norm_matvec` epilogue `silu_mul`
  (gate and up rows interleaved so one task owns both halves of its outputs);
  with the final `argmax`                             -> `norm_matvec` epilogue `argmax`
  (each task writes its (max, index)) + `argmax` (the reduction over tasks);
- `linear` + residual `add`                           -> `matvec_add`;
- with `ffn_split_k` (a compile option, off by default), a dense MLP's norm, gate/up,
  `silu_mul`, down and residual `add`                 -> `ffn_split_k`, one op instead of two
  (see `_fuse_split_k`);
- `head_rms_norm` (qk-norm) + `rope` + `kv_append` + `attention`
                                                      -> `attention` with a prologue.
  The prologue goes into attention, not into the QKV epilogue, because QKV is tiled by rows
  for balance across SMs while the prologue needs whole heads; the attention task of a KV
  group holds exactly the heads it needs.
- MLA attention and the DSA indexer: see `fusion_mla.py`; the MoE block: `fusion_moe.py`.

A fused op lists the buffers it reads and writes as inputs and outputs, so the graph's edges
stay the true dependencies. An input that is a part of a concatenated output is read through
its view (`locate`): the base tensor and an offset (`in_offset` of a `norm_matvec`, or the
`io` attr of the other fused ops: role -> [base tensor, offset]).
"""

from __future__ import annotations

import dataclasses

from tilertc.ir.graph import Graph, Op, TensorKind
from tilertc.passes.program import Program, ScheduleError

FUSED_OPCODES = ("embed", "norm_matvec", "matvec_add", "attention", "argmax",
                 "head_matvec", "mla_attention", "dsa_score", "dsa_topk",
                 "moe_topk", "moe_gate_up", "moe_down_add", "ffn_split_k")
# Fraction bits of the fixed-point residual stream a split-K FFN accumulates into (see
# `_fuse_split_k`): |x| < 2^31, resolution 2^-32.
FIXED_FRAC_BITS = 32
# names of multi-projection norm_matvecs by the norm that feeds them (others: "<norm>_proj")
PROJECTION_NAMES = {"input_norm": "attn_in_proj", "q_resid_norm": "q_b_proj"}


class Fusion:
    """The state of one fusion run: the source graph, the fused graph being built, the views
    of concatenated outputs, and which source ops are already folded."""

    def __init__(self, program: Program) -> None:
        self.program, self.g = program, program.graph
        self.out = Graph(self.g.name)
        self.out.attrs = dict(self.g.attrs, views={})
        self.out.tensors = dict(self.g.tensors)
        self.done: set[str] = set()
        self.writer = {t: op for op in self.g.ops() for t in op.outputs}
        self.readers: dict[str, list[Op]] = {}
        self.layers: dict[int | None, list[Op]] = {}
        for op in self.g.ops():
            self.layers.setdefault(op.layer, []).append(op)
            for t in dict.fromkeys(op.inputs):
                self.readers.setdefault(t, []).append(op)

    def emit(self, name: str, opcode: str, inputs: list[str], outputs: list[str],
             layer: int | None, fused: list[Op], **attrs: object) -> None:
        assert opcode in FUSED_OPCODES, opcode
        self.out.add(name, opcode, inputs, outputs, layer, fused_from=[o.name for o in fused],
                     **attrs)
        self.done.update(o.name for o in fused)

    def consumers(self, tensor: str) -> list[Op]:
        return self.readers.get(tensor, [])

    def locate(self, tensor: str) -> tuple[str, int]:
        """The buffer that holds `tensor` and its offset there (itself, or a concatenation)."""
        base, offset = self.out.attrs["views"].get(tensor, (tensor, 0))
        return base, offset

    def concat(self, name: str, parts: list[str]) -> str:
        """A new activation holding `parts` back to back; each part becomes a view of it."""
        sizes = [self.g.tensors[p].numel for p in parts]
        self.out.tensor(name, (sum(sizes),), "fp32", TensorKind.ACTIVATION,
                        parts=[[p, n] for p, n in zip(parts, sizes, strict=True)])
        at = 0
        for p, n in zip(parts, sizes, strict=True):
            self.out.attrs["views"][p] = [name, at]
            at += n
        return name

    def derived(self, weight: str, kind: str, shape: tuple[int, int], **attrs: object) -> str:
        """A weight the runtime derives from a checkpoint tensor when it packs (e.g. a
        transposed slice); it replaces that tensor in the fused graph. `attrs` add to the
        source's (an FP8 weight's `scale_inv` and `block`), e.g. `scale_cols`."""
        src = self.g.tensors[weight]
        name = self.out.tensor(f"{weight}.{kind}", shape, src.dtype, TensorKind.WEIGHT,
                               src.hf_name, **src.attrs, derived=kind, source=weight, **attrs)
        self.out.tensors.pop(weight, None)
        return name


def fuse(program: Program) -> Program:
    from tilertc.passes.fusion_mla import fuse_mla
    from tilertc.passes.fusion_moe import fuse_moe

    f = Fusion(program)
    ops = f.g.ops()
    for op in ops:
        if op.name in f.done:
            continue
        if op.opcode == "embedding":
            f.emit(op.name, "embed", list(op.inputs), list(op.outputs), op.layer, [op])
        elif op.opcode == "rms_norm":
            if any(c.opcode == "moe_router" for c in f.consumers(op.outputs[0])):
                fuse_moe(f, op)
            else:
                _fuse_norm(f, op)
        elif op.opcode == "linear":
            _fuse_residual(f, op)
        elif op.opcode in ("head_rms_norm", "rope", "kv_append", "attention"):
            if program.spec.mla is not None:
                fuse_mla(f, op)
            else:
                _fuse_attention(f, op)
        else:
            raise ScheduleError(f"op {op.name!r}: opcode {op.opcode!r} has no fused form")
    _start_values(f)
    program.graph = f.out
    counts: dict[str, int] = {}
    for op in f.out.ops():
        counts[op.opcode] = counts.get(op.opcode, 0) + 1
    program.decide("fusion", f"{len(ops)} ops -> {len(f.out.ops())} fused ops: " +
                   ", ".join(f"{n} {k}" for k, n in counts.items()))
    return program


def operands(g: Graph, op: Op) -> list[str]:
    """A linear's inputs without the block scales of an FP8 weight. The scales are packed into
    the weight's rows (passes/packing.py), so a fused op names only the weight, whose
    `scale_inv` attr leads to them."""
    scales = {g.tensors[i].attrs.get("scale_inv") for i in op.inputs}
    return [i for i in op.inputs if i not in scales]


def _fuse_residual(f: Fusion, op: Op) -> None:
    users = f.consumers(op.outputs[0])
    ins = operands(f.g, op)
    if len(users) != 1 or users[0].opcode != "add" or len(ins) != 2:
        raise ScheduleError(f"op {op.name!r}: a linear not followed by a residual add has "
                            "no fused form in this backend")
    add = users[0]
    res = next(t for t in add.inputs if t != op.outputs[0])
    k = f.g.tensors[ins[1]].shape[1]
    f.emit(op.name, "matvec_add", [ins[0], ins[1], res], list(add.outputs),
           op.layer, [op, add], K=k, rows=f.g.tensors[ins[1]].shape[0])


def _fuse_norm(f: Fusion, norm: Op) -> None:
    g = f.g
    linears = f.consumers(norm.outputs[0])
    if not linears or any(op.opcode != "linear" or len(operands(g, op)) != 2 for op in linears):
        raise ScheduleError(f"op {norm.name!r}: rms_norm must feed bias-free linears to be fused")
    weights = [op.inputs[1] for op in linears]
    k = g.tensors[weights[0]].shape[1]
    x, offset = f.locate(norm.inputs[0])
    gamma = norm.inputs[1]
    common = {"K": k, "eps": norm.attrs["eps"], "in_offset": offset}
    users = [u for op in linears for u in f.consumers(op.outputs[0])]
    if len(linears) == 2 and len(users) == 2 and users[0] is users[1] and \
            users[0].opcode == "silu_mul":
        act = users[0]
        if f.program.config.get("tuning", {}).get("ffn_split_k"):
            _fuse_split_k(f, norm, linears, act)
            return
        rows = g.tensors[weights[0]].shape[0]
        name = linears[0].name.rsplit(".", 1)[0] + ".gate_up_proj"
        f.emit(name, "norm_matvec", [x, gamma, *weights], list(act.outputs), norm.layer,
               [norm, *linears, act], rows=rows, epilogue="silu_mul", interleave=True, **common)
        return
    if len(linears) == 1 and len(users) == 1 and users[0].opcode == "argmax":
        rows = g.tensors[weights[0]].shape[0]
        f.emit(linears[0].name, "norm_matvec", [x, gamma, *weights], list(linears[0].outputs),
               norm.layer, [norm, linears[0]], rows=rows, epilogue="argmax", interleave=False,
               **common)
        sample = users[0]
        f.emit(sample.name, "argmax", list(sample.inputs), list(sample.outputs), None, [sample])
        return
    if [op.name.rsplit(".", 1)[-1] for op in linears] == ["q_proj", "k_proj", "v_proj"]:
        name, concat = f"layers.{norm.layer}.qkv_proj", f"layers.{norm.layer}.qkv"
    else:
        short = norm.name.rsplit(".", 1)[-1]
        name = concat = f"layers.{norm.layer}.{PROJECTION_NAMES.get(short, short + '_proj')}"
    by_format = _by_format(g, linears)
    for i, (fmt, group) in enumerate(by_format.items()):
        suffix = f".{fmt}" if i else ""  # the first format's op keeps the plain name
        if len(linears) == 1:
            op_name, out = linears[0].name, linears[0].outputs[0]
        elif len(group) == 1:
            op_name, out = name + suffix, group[0].outputs[0]
        else:
            op_name, out = name + suffix, f.concat(concat + suffix, [op.outputs[0] for op in group])
        f.emit(op_name, "norm_matvec", [x, gamma, *(op.inputs[1] for op in group)], [out],
               norm.layer, [norm, *group], rows=sum(g.tensors[op.inputs[1]].shape[0]
                                                   for op in group),
               epilogue="none", interleave=False, **common)
    if len(by_format) > 1:
        f.program.decide("fusion", f"{name}: one norm_matvec per weight format ("
                         + "; ".join(f"{fmt}: {', '.join(op.name.split('.', 2)[-1] for op in ops)}"
                                     for fmt, ops in by_format.items())
                         + "), as a task streams rows of one format")


def _by_format(g: Graph, linears: list[Op]) -> dict[str, list[Op]]:
    """The linears by the format of their weight, formats in order of first use. An FP8 model
    keeps a few small projections bf16 (the DSA indexer's head weights), which may share
    their input norm with FP8 ones."""
    out: dict[str, list[Op]] = {}
    for op in linears:
        out.setdefault(g.tensors[op.inputs[1]].dtype, []).append(op)
    return out


def _fuse_split_k(f: Fusion, norm: Op, linears: list[Op], act: Op) -> None:
    """A dense MLP as one op whose tasks each own a slice of the intermediate dimension
    (split-K over the down projection): norm, gate/up rows of the slice, `silu_mul` into shared
    memory, then the slice's columns of W_down, whose partial sums (all `hidden` of them) are
    added into the layer's output. Without it the MLP is two all-to-all ops (gate/up, then
    down), and each op boundary costs a counter wait on every SM plus the down tasks' staging
    of the whole intermediate vector from L2; here the intermediate vector never leaves the SM.

    The output x.ffn becomes a sum of every task's contribution onto a start value, x.attn,
    which the op that writes x.attn (o_proj's `matvec_add`) also writes there (`_start_values`).
    The sum's bits do not depend on the order of the adds: x.ffn is a signed 64-bit
    fixed-point buffer (dtype `fx64`, `FIXED_FRAC_BITS` = 32 fraction bits) and each
    contribution is rounded to it before an integer add (integer addition is
    associative; partial sums that wrap cancel, as long as the final value fits). The range
    is |x.ffn| < 2^31, far above a bf16 model's residual stream; the resolution 2^-32 adds at
    most (tasks + 1) x 2^-33 (~1.5e-8 at 132 tasks) to the f32 path's error, below one f32
    rounding of any value above ~2^-8. Its readers (the next layer's norm prologue and
    residual, or the final norm) convert it back to fp32. Refused, by name, where the kernel
    does not cover it: FP8 weights (a slice of down columns would cut 128-wide scale blocks)
    and tensor parallelism (the down projection's all-reduce)."""
    g, layer = f.g, norm.layer
    down = f.consumers(act.outputs[0])
    add = f.consumers(down[0].outputs[0]) if len(down) == 1 else []
    name = linears[0].name.rsplit(".", 1)[0] + ".split_k"
    if len(down) != 1 or down[0].opcode != "linear" or len(operands(g, down[0])) != 2 or \
            len(add) != 1 or add[0].opcode != "add":
        raise ScheduleError(f"op {name!r}: ffn_split_k needs gate/up, silu_mul, one bias-free "
                            "down projection and a residual add")
    weights = [op.inputs[1] for op in (*linears, down[0])]
    if any("scale_inv" in g.tensors[w].attrs for w in weights):
        raise ScheduleError(f"op {name!r}: ffn_split_k is not yet supported with FP8 weights "
                            "(a slice of W_down's columns would cut its 128-column scale "
                            "blocks); compile with --weight-dtype bf16 or without ffn_split_k")
    if f.program.tp != 1:
        raise ScheduleError(f"op {name!r}: ffn_split_k runs at --tp 1 only, not --tp "
                            f"{f.program.tp} (the down projection's all-reduce)")
    x, offset = f.locate(norm.inputs[0])
    res = next(t for t in add[0].inputs if t != down[0].outputs[0])
    if res != norm.inputs[0] or offset:
        raise ScheduleError(f"op {name!r}: ffn_split_k needs the residual to be the norm's input")
    out = add[0].outputs[0]
    t = g.tensors[out]
    f.out.tensors[out] = dataclasses.replace(t, dtype="fx64",
                                             attrs={**t.attrs, "frac_bits": FIXED_FRAC_BITS})
    inter = g.tensors[weights[0]].shape[0]
    f.emit(name, "ffn_split_k", [x, norm.inputs[1], *weights], [out], layer,
           [norm, *linears, act, down[0], add[0]], K=g.tensors[weights[0]].shape[1],
           eps=norm.attrs["eps"], in_offset=0, rows=inter, intermediate_size=inter,
           epilogue="silu_mul", interleave=True, accumulate=True)


def _start_values(f: Fusion) -> None:
    """The start value of every split-K FFN's output: the op that writes its residual input
    (o_proj's `matvec_add`, x.attn = x + W_o a) writes it to the fixed-point output too
    (`start_value`), and it becomes an output of that op. The FFN's tasks wait for that op
    (they read x.attn), so its writes come before their adds; the output's readers wait for
    the FFN op, so they see every add. Every reader of a fixed-point buffer must be one whose
    kernel code converts it (a norm prologue's input, a residual), checked here by name."""
    ops = f.out.ops()
    writer = {t: op for op in ops for t in op.outputs}
    changed = False
    for op in ops:
        if op.opcode != "ffn_split_k":
            continue
        src, out = writer.get(op.inputs[0]), op.outputs[0]
        if src is None or src.opcode != "matvec_add":
            raise ScheduleError(f"op {op.name!r}: ffn_split_k needs its residual written by a "
                                "matvec_add (which also writes the start value)")
        src.outputs = (*src.outputs, out)
        src.attrs["start_value"] = out
        changed = True
    for op in ops:
        for role, t in enumerate(op.inputs):
            if f.out.tensors[t].dtype != "fx64":
                continue
            if (op.opcode, role) not in (("norm_matvec", 0), ("matvec_add", 2)):
                raise ScheduleError(f"op {op.name!r} reads the fixed-point {t!r} of a split-K "
                                    f"FFN as its input {role}, which its kernel code does not "
                                    "convert; compile without ffn_split_k")
    if changed:
        f.out.rebuild_edges()
        n = sum(op.opcode == "ffn_split_k" for op in ops)
        f.program.decide("fusion", f"ffn_split_k: {n} dense MLPs as one split-K op each (one "
                         "all-to-all boundary less per layer); their outputs are 64-bit fixed "
                         f"point ({FIXED_FRAC_BITS} fraction bits), so the sum of the tasks' "
                         "parts does not depend on their order; the matvec_add before each "
                         "writes its start value")


def _fuse_attention(f: Fusion, first: Op) -> None:
    """Fold the qk-norm/rope/kv-append chain of one layer into its attention op."""
    chain = [op for op in f.layers[first.layer] if
             op.opcode in ("head_rms_norm", "rope", "kv_append", "attention")]
    attn = chain[-1]
    if attn.opcode != "attention":
        raise ScheduleError(f"layer {first.layer}: attention chain does not end in attention")
    by_code: dict[str, list[Op]] = {}
    for op in chain:
        by_code.setdefault(op.opcode, []).append(op)
    qkv = f.out.op(f"layers.{first.layer}.qkv_proj")
    norms = [op.inputs[1] for op in by_code.get("head_rms_norm", [])]
    kv = by_code["kv_append"][0]
    rope = by_code["rope"][0]
    a = attn.attrs
    f.emit(attn.name, "attention", [qkv.outputs[0], *norms, *kv.outputs], list(attn.outputs),
           attn.layer, chain, n_heads=a["n_heads"], n_kv_heads=a["n_kv_heads"],
           head_dim=a["head_dim"], scale=a["scale"], rope=rope.attrs["rope"],
           qk_norm=bool(norms), eps=by_code["head_rms_norm"][0].attrs["eps"] if norms else 0.0)
