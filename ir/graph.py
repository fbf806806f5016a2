"""The tile IR: a networkx graph of typed ops over explicit tensors.

Nodes are ops (`Op`), keyed by their unique name; an edge u -> v means v reads a tensor that u
writes (the edge's `tensors` attribute lists which). Tensors live in `Graph.tensors` and say
what they are (`TensorKind`): weights (with their Hugging Face name), per-token activations,
the KV cache, scratch. Activation shapes are per token: the interpreter runs an op over T
tokens by adding a leading dimension, and a decode step is T = 1.

Passes annotate ops and tensors through their `attrs` dicts; the graph stays the single record of
what was decided. Op order is deterministic (insertion order, which is a topological order),
and `to_json` gives a stable serialized form.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import networkx as nx

# fx64: a signed 64-bit fixed-point value (its tensor's `frac_bits` attr), the sum a split-K
# FFN accumulates (passes/fusion.py: _fuse_split_k)
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8_e4m3": 1, "int32": 4, "int64": 8, "fx64": 8}


class TensorKind(str, Enum):
    WEIGHT = "weight"  # read-only model parameter, streamed from HBM every token
    ACTIVATION = "activation"  # per-token value produced and consumed within one step
    KV_CACHE = "kv_cache"  # persistent across steps; one row appended per token
    SCRATCH = "scratch"  # per-step temporaries that are not part of the model's dataflow
    INPUT = "input"  # fed by the host each step (token id, position)
    OUTPUT = "output"  # read back by the host (logits, token)


@dataclass
class Tensor:
    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: TensorKind
    hf_name: str | None = None  # weights: key in a Hugging Face state dict
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "kind": self.kind.value,
            "hf_name": self.hf_name,
            "attrs": self.attrs,
        }


@dataclass
class Op:
    name: str
    opcode: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict[str, Any] = field(default_factory=dict)
    layer: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "opcode": self.opcode,
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "attrs": self.attrs,
            "layer": self.layer,
        }


class Graph:
    """One decode step of one model."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.tensors: dict[str, Tensor] = {}
        self.nx = nx.DiGraph()
        self.attrs: dict[str, Any] = {}
        self._writer: dict[str, str] = {}  # tensor -> op that last wrote it

    # -- construction -------------------------------------------------------------------------
    def tensor(self, name: str, shape: tuple[int, ...], dtype: str, kind: TensorKind,
               hf_name: str | None = None, **attrs: Any) -> str:
        if name in self.tensors:
            raise ValueError(f"tensor {name!r} defined twice in graph {self.name!r}")
        self.tensors[name] = Tensor(name, tuple(int(s) for s in shape), dtype, kind, hf_name,
                                    dict(attrs))
        return name

    def add(self, name: str, opcode: str, inputs: list[str] | tuple[str, ...],
            outputs: list[str] | tuple[str, ...], layer: int | None = None, **attrs: Any) -> Op:
        if name in self.nx:
            raise ValueError(f"op {name!r} defined twice in graph {self.name!r}")
        for t in (*inputs, *outputs):
            if t not in self.tensors:
                raise ValueError(f"op {name!r} uses undeclared tensor {t!r}")
        op = Op(name, opcode, tuple(inputs), tuple(outputs), dict(attrs), layer)
        self.nx.add_node(name, op=op)
        for t in inputs:
            src = self._writer.get(t)
            if src is not None:
                if self.nx.has_edge(src, name):
                    self.nx.edges[src, name]["tensors"].append(t)
                else:
                    self.nx.add_edge(src, name, tensors=[t])
        for t in outputs:
            self._writer[t] = name
        return op

    # -- queries ------------------------------------------------------------------------------
    def ops(self) -> list[Op]:
        """Ops in program order (insertion order, a topological order)."""
        return [self.nx.nodes[n]["op"] for n in self.nx.nodes]

    def op(self, name: str) -> Op:
        return self.nx.nodes[name]["op"]

    def producers(self, op_name: str) -> list[Op]:
        return [self.op(p) for p in self.nx.predecessors(op_name)]

    def consumers(self, op_name: str) -> list[Op]:
        return [self.op(s) for s in self.nx.successors(op_name)]

    def weights(self) -> list[Tensor]:
        return [t for t in self.tensors.values() if t.kind is TensorKind.WEIGHT]

    def weight_bytes(self) -> int:
        """Bytes of weights a decode step reads (every weight once; MoE experts all counted)."""
        return sum(t.nbytes for t in self.weights())

    def replace_ops(self, old: list[str], new: Op) -> None:
        """Replace a connected group of ops by one op (used by fusion), keeping program order."""
        order = list(self.nx.nodes)
        first = min(order.index(o) for o in old)
        rebuilt = nx.DiGraph()
        for i, n in enumerate(order):
            if i == first:
                rebuilt.add_node(new.name, op=new)
            if n not in old:
                rebuilt.add_node(n, **self.nx.nodes[n])
        self.nx = rebuilt
        self.rebuild_edges()

    def rebuild_edges(self) -> None:
        """Derive the edges again from the ops' inputs and outputs (after a pass changed
        an op's outputs)."""
        self._writer = {}
        self.nx.remove_edges_from(list(self.nx.edges))
        for op in self.ops():
            for t in op.inputs:
                src = self._writer.get(t)
                if src is not None:
                    if self.nx.has_edge(src, op.name):
                        self.nx.edges[src, op.name]["tensors"].append(t)
                    else:
                        self.nx.add_edge(src, op.name, tensors=[t])
            for t in op.outputs:
                self._writer[t] = op.name

    # -- serialization ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "attrs": self.attrs,
            "tensors": [t.to_dict() for t in self.tensors.values()],
            "ops": [o.to_dict() for o in self.ops()],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True, default=_jsonable)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Graph:
        g = cls(d["name"])
        g.attrs = dict(d["attrs"])
        for t in d["tensors"]:
            g.tensors[t["name"]] = Tensor(t["name"], tuple(t["shape"]), t["dtype"],
                                          TensorKind(t["kind"]), t["hf_name"], dict(t["attrs"]))
        for o in d["ops"]:
            op = Op(o["name"], o["opcode"], tuple(o["inputs"]), tuple(o["outputs"]),
                    dict(o["attrs"]), o["layer"])
            g.nx.add_node(op.name, op=op)
        g.rebuild_edges()
        return g


def _jsonable(x: Any) -> Any:
    if isinstance(x, tuple):
        return list(x)
    if isinstance(x, Enum):
        return x.value
    if hasattr(x, "to_dict"):
        return x.to_dict()
    raise TypeError(f"not serializable: {type(x).__name__}")
