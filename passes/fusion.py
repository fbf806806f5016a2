"""Fusion: fold elementwise work into the matrix-vector products and attention around it.

Decides which ops become one kernel instruction. At batch 1 every op boundary costs a
synchronization and a round trip of the activation through L2, while elementwise work is free
next to the weight stream, so everything elementwise is folded into a neighbour:

- `rms_norm` + the `linear`s that read it            -> `norm_matvec` (q/k/v become one op);
  with `silu_mul` over a gate/up pair                 -> `norm_matvec` epilogue `silu_mul`
  (gate and up rows interleaved so one task owns both halves of its outputs);
  with the final `argmax`                             -> `norm_matvec` epilogue `argmax`
  (each task writes its (max, index)) + `argmax` (the reduction over tasks);
- `linear` + residual `add`                           -> `matvec_add`;
- `head_rms_norm` (qk-norm) + `rope` + `kv_append` + `attention`
                                                      -> `attention` with a prologue.
  The prologue goes into attention, not into the QKV epilogue, because QKV is tiled by rows
  for balance across SMs while the prologue needs whole heads; the attention task of a KV
  group holds exactly the heads it needs.
"""

from __future__ import annotations

from tilertc.ir.graph import Graph, Op, TensorKind
from tilertc.passes.program import Program, ScheduleError

FUSED_OPCODES = ("embed", "norm_matvec", "matvec_add", "attention", "argmax")


def _only_consumers(g: Graph, tensor: str) -> list[Op]:
    return [op for op in g.ops() if tensor in op.inputs]


def fuse(program: Program) -> Program:
    g = program.graph
    out = Graph(g.name)
    out.attrs = dict(g.attrs)
    out.tensors = dict(g.tensors)
    ops = g.ops()
    done: set[str] = set()

    def emit(name: str, opcode: str, inputs: list[str], outputs: list[str], layer: int | None,
             fused: list[Op], **attrs: object) -> None:
        out.add(name, opcode, inputs, outputs, layer, fused_from=[o.name for o in fused], **attrs)
        done.update(o.name for o in fused)

    for op in ops:
        if op.name in done:
            continue
        if op.opcode == "embedding":
            emit(op.name, "embed", list(op.inputs), list(op.outputs), op.layer, [op])
        elif op.opcode == "rms_norm":
            _fuse_norm(g, out, op, emit)
        elif op.opcode == "linear":
            users = _only_consumers(g, op.outputs[0])
            if len(users) != 1 or users[0].opcode != "add" or len(op.inputs) != 2:
                raise ScheduleError(f"op {op.name!r}: a linear not followed by a residual add has "
                                    "no fused form in this backend")
            add = users[0]
            res = next(t for t in add.inputs if t != op.outputs[0])
            k = g.tensors[op.inputs[1]].shape[1]
            emit(op.name, "matvec_add", [op.inputs[0], op.inputs[1], res], list(add.outputs),
                 op.layer, [op, add], K=k, rows=g.tensors[op.inputs[1]].shape[0])
        elif op.opcode in ("head_rms_norm", "rope", "kv_append", "attention"):
            _fuse_attention(g, out, op, emit)
        else:
            raise ScheduleError(f"op {op.name!r}: opcode {op.opcode!r} has no fused form in this "
                                "backend yet (dense GQA/SwiGLU models are supported)")
    program.graph = out
    counts: dict[str, int] = {}
    for op in out.ops():
        counts[op.opcode] = counts.get(op.opcode, 0) + 1
    program.decide("fusion", f"{len(ops)} ops -> {len(out.ops())} fused ops: " +
                   ", ".join(f"{n} {k}" for k, n in counts.items()))
    return program


def _fuse_norm(g: Graph, out: Graph, norm: Op, emit) -> None:
    linears = _only_consumers(g, norm.outputs[0])
    if not linears or any(op.opcode != "linear" or len(op.inputs) != 2 for op in linears):
        raise ScheduleError(f"op {norm.name!r}: rms_norm must feed bias-free linears to be fused")
    weights = [op.inputs[1] for op in linears]
    k = g.tensors[weights[0]].shape[1]
    x, gamma = norm.inputs
    users = [u for op in linears for u in _only_consumers(g, op.outputs[0])]
    name = linears[0].name if len(linears) == 1 else f"layers.{norm.layer}.qkv_proj"
    if len(linears) == 2 and len(users) == 2 and users[0] is users[1] and users[0].opcode == "silu_mul":
        act = users[0]
        rows = g.tensors[weights[0]].shape[0]
        name = f"layers.{norm.layer}.gate_up_proj"
        emit(name, "norm_matvec", [x, gamma, *weights], list(act.outputs), norm.layer,
             [norm, *linears, act], K=k, rows=rows, eps=norm.attrs["eps"], epilogue="silu_mul",
             interleave=True)
        return
    if len(linears) == 1 and len(users) == 1 and users[0].opcode == "argmax":
        rows = g.tensors[weights[0]].shape[0]
        emit(name, "norm_matvec", [x, gamma, *weights], list(linears[0].outputs), norm.layer,
             [norm, linears[0]], K=k, rows=rows, eps=norm.attrs["eps"], epilogue="argmax",
             interleave=False)
        sample = users[0]
        emit(sample.name, "argmax", list(sample.inputs), list(sample.outputs), None, [sample])
        return
    rows = sum(g.tensors[w].shape[0] for w in weights)
    fused_out = out.tensor(f"layers.{norm.layer}.qkv" if len(linears) > 1 else linears[0].outputs[0] + ".fused",
                           (rows,), "fp32", TensorKind.ACTIVATION,
                           parts=[[op.outputs[0], g.tensors[op.outputs[0]].shape[0]] for op in linears])
    emit(name, "norm_matvec", [x, gamma, *weights], [fused_out], norm.layer, [norm, *linears],
         K=k, rows=rows, eps=norm.attrs["eps"], epilogue="none", interleave=False)


def _fuse_attention(g: Graph, out: Graph, first: Op, emit) -> None:
    """Fold the qk-norm/rope/kv-append chain of one layer into its attention op."""
    chain = [op for op in g.ops() if op.layer == first.layer and
             op.opcode in ("head_rms_norm", "rope", "kv_append", "attention")]
    attn = chain[-1]
    if attn.opcode != "attention":
        raise ScheduleError(f"layer {first.layer}: attention chain does not end in attention")
    by_code: dict[str, list[Op]] = {}
    for op in chain:
        by_code.setdefault(op.opcode, []).append(op)
    qkv = next(op for op in out.ops() if op.layer == first.layer and op.opcode == "norm_matvec"
               and op.name.endswith("qkv_proj"))
    norms = [op.inputs[1] for op in by_code.get("head_rms_norm", [])]
    kv = by_code["kv_append"][0]
    rope = by_code["rope"][0]
    a = attn.attrs
    emit(attn.name, "attention", [qkv.outputs[0], *norms, *kv.outputs], list(attn.outputs),
         attn.layer, chain, n_heads=a["n_heads"], n_kv_heads=a["n_kv_heads"], head_dim=a["head_dim"],
         scale=a["scale"], rope=rope.attrs["rope"], qk_norm=bool(norms),
         eps=by_code["head_rms_norm"][0].attrs["eps"] if norms else 0.0)
