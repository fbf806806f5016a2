"""The reference interpreter: exact semantics of every opcode, in torch.

It is the oracle for everything after the IR: the schedule verifier runs task slices of these
same functions, and the kernel is compared with its logits. It runs a step over T tokens at
once (prefill) or one (decode), on CPU or CUDA, computing in `dtype` (float32 by default) with
weights upcast from whatever they are stored in. KV caches persist between steps.

An opcode's semantics is a function `(op, inputs, step) -> outputs` registered with `@semantics`;
inputs are torch tensors with a leading token dimension for activations.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tilertc.ir.fp8 import dequantize
from tilertc.ir.graph import Graph, Op, Tensor, TensorKind
from tilertc.ir.rope import apply_rope, cos_sin


@dataclass
class Step:
    """What a step's ops may read besides their inputs: token positions and persistent state."""

    positions: torch.Tensor  # [T] int64
    state: dict[str, torch.Tensor]  # KV caches and other persistent buffers, by tensor name
    dtype: torch.dtype


Semantics = Callable[[Op, list[torch.Tensor], Step], list[torch.Tensor]]
SEMANTICS: dict[str, Semantics] = {}
# Opcodes whose semantics get their weights in the weights' own dtype and widen only those they
# use (a MoE layer's chosen experts), rather than every weight input widened before the call.
OWN_WIDENING: set[str] = set()


def semantics(*opcodes: str, own_widening: bool = False) -> Callable[[Semantics], Semantics]:
    def register(fn: Semantics) -> Semantics:
        for name in opcodes:
            SEMANTICS[name] = fn
            if own_widening:
                OWN_WIDENING.add(name)
        return fn

    return register


# -- dense ops ---------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@semantics("embedding")
def _embedding(op: Op, ins: list[torch.Tensor], step: Step) -> list[torch.Tensor]:
    ids, table = ins
    return [table[ids.reshape(-1)].to(step.dtype)]


@semantics("rms_norm")
def _rms_norm(op: Op, ins: list[torch.Tensor], step: Step) -> list[torch.Tensor]:
    x, w = ins
    return [rms_norm(x, w, op.attrs["eps"])]


@semantics("head_rms_norm")
def _head_rms_norm(op: Op, ins: list[torch.Tensor], step: Step) -> list[torch.Tensor]:
    x, w = ins
    t = x.shape[0]
    y = rms_norm(x.reshape(t, op.attrs["n_heads"], op.attrs["head_dim"]), w, op.attrs["eps"])
    return [y.reshape(t, -1)]


@semantics("linear")
def _linear(op: Op, ins: list[torch.Tensor], step: Step) -> list[torch.Tensor]:
    return [F.linear(ins[0], ins[1], ins[2] if len(ins) > 2 else None)]


@semantics("layer_norm")
def _layer_norm(op: Op, ins: list[torch.Tensor], step: Step) -> list[torch.Tensor]:
    x, w, b = ins
    return [F.layer_norm(x, (x.shape[-1],), w, b, op.attrs["eps"])]


@semantics("split")
def _split(op: Op, ins: list[torch.Tensor], step: Step) -> list[torch.Tensor]:
    """Consecutive slices of the last dimension, `sizes` wide (e.g. latent | rope part)."""
    return list(torch.split(ins[0], list(op.attrs["sizes"]), dim=-1))


@semantics("rope")
def _rope(op: Op, ins: list[torch.Tensor], step: Step) -> list[torch.Tensor]:
    """RoPE on each head's dims [rotary_offset, rotary_offset + rotary_dim) (default: all of
    them); the others pass through, as in MLA heads (nope | rope) and DSA indexer heads."""
    x = ins[0]
    a = op.attrs
    t = x.shape[0]
    lo = a.get("rotary_offset", 0)
    hi = lo + a.get("rotary_dim", a["head_dim"])
    heads = x.reshape(t, a["n_heads"], a["head_dim"])
    cos, sin = cos_sin(a["rope"], hi - lo, step.positions)
    rotated = apply_rope(heads[..., lo:hi], cos, sin, a["rope"]["interleaved"])
    return [torch.cat((heads[..., :lo], rotated, heads[..., hi:]), dim=-1).reshape(t, -1)]


@semantics("kv_append")
def _kv_append(op: Op, ins: list[torch.Tensor], step: Step) -> list[torch.Tensor]:
    outs = []
    for src, cache_name in zip(ins[:-1], op.outputs, strict=True):
        cache = step.state[cache_name]
        cache[step.positions] = src.reshape(src.shape[0], *cache.shape[1:]).to(cache.dtype)
        outs.append(cache)
    return outs


def causal_mask(step: Step, n_keys: int) -> torch.Tensor:
    """[T, n_keys] True where a query token may see a cached key (key position <= its own)."""
    keys = torch.arange(n_keys, device=step.positions.device)
    return keys[None, :] <= step.positions[:, None]


@semantics("attention")
def _attention(op: Op, ins: list[torch.Tensor], step: Step) -> list[torch.Tensor]:
    q, kc, vc = ins[0], ins[1], ins[2]
    a = op.attrs
    t, nh, nkv, hd = q.shape[0], a["n_heads"], a["n_kv_heads"], a["head_dim"]
    n = int(step.positions.max()) + 1
    k = kc[:n].to(step.dtype).repeat_interleave(nh // nkv, dim=1)  # [n, nh, hd]
    v = vc[:n].to(step.dtype).repeat_interleave(nh // nkv, dim=1)
    scores = torch.einsum("thd,nhd->thn", q.reshape(t, nh, hd), k) * a["scale"]
    scores = scores.masked_fill(~causal_mask(step, n)[:, None, :], float("-inf"))
    p = scores.softmax(-1)
    return [torch.einsum("thn,nhd->thd", p, v).reshape(t, nh * hd)]


@semantics("add")
def _add(op: Op, ins: list[torch.Tensor], step: Step) -> list[torch.Tensor]:
    return [ins[0] + ins[1]]


@semantics("silu_mul")
def _silu_mul(op: Op, ins: list[torch.Tensor], step: Step) -> list[torch.Tensor]:
    return [F.silu(ins[0]) * ins[1]]


@semantics("argmax")
def _argmax(op: Op, ins: list[torch.Tensor], step: Step) -> list[torch.Tensor]:
    return [ins[0].argmax(-1, keepdim=True)]


# -- running a graph ---------------------------------------------------------------------------

def _load_semantics() -> None:
    """Import the modules that register the semantics of the other families' opcodes."""
    import importlib

    for mod in ("tilertc.ir.moe", "tilertc.ir.mla", "tilertc.ir.dsa"):
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise


def checked_weight(t: Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """The tensor of weight `t` in `weights` (by Hugging Face name), with the declared shape."""
    if t.hf_name not in weights:
        raise KeyError(f"weight {t.hf_name!r} (tensor {t.name!r}) is missing from the weights")
    w = weights[t.hf_name]
    if tuple(w.shape) != t.shape:
        raise ValueError(f"weight {t.hf_name!r} has shape {tuple(w.shape)}, the model needs "
                         f"{t.shape}")
    return w


@dataclass(frozen=True)
class BlockScaled:
    """An FP8 weight as stored (e4m3) with its block scales, dequantized (exactly, in float32)
    only when an op widens it: on the device it takes 1 byte per value, not 4."""

    weight: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int]

    def to(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.weight, self.scale_inv, self.block).to(dtype)


class Interpreter:
    """Runs a graph step by step with weights given by Hugging Face name."""

    def __init__(self, graph: Graph, weights: dict[str, torch.Tensor],
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 cache_dtype: torch.dtype | None = None) -> None:
        _load_semantics()
        self.graph, self.device, self.dtype = graph, torch.device(device), dtype
        self.params: dict[str, torch.Tensor | BlockScaled] = {}
        # Block scales of FP8 weights: kept with their weight (BlockScaled), so no op sees them.
        self.scales = {t.attrs["scale_inv"] for t in graph.weights() if "scale_inv" in t.attrs}
        # Weights stay in their own dtype on the device and are widened one op at a time (an
        # exact conversion; FP8 ones dequantized): a 30B model's bf16 or FP8 weights fit beside
        # the kernel's packed copy, an fp32 copy of all of them would not.
        for t in graph.weights():
            if t.name not in self.scales:
                self.params[t.name] = self.stored_weight(t, weights)
        self.state = self._empty_state(cache_dtype)
        unknown = sorted({op.opcode for op in graph.ops()} - SEMANTICS.keys())
        if unknown:
            raise NotImplementedError(f"no interpreter semantics for opcodes {unknown}")

    def _empty_state(self, cache_dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        return {t.name: torch.zeros(t.shape, dtype=cache_dtype or self.dtype, device=self.device)
                for t in self.graph.tensors.values() if t.kind is TensorKind.KV_CACHE}

    def fresh(self, cache_dtype: torch.dtype | None = None) -> Interpreter:
        """Another interpreter over the same weights with an empty cache (in `cache_dtype`, else
        the compute dtype). It shares the weights already on the device rather than copying
        them: a second copy of a 30B model's does not fit beside the kernel's packed one."""
        other = copy.copy(self)
        other.state = self._empty_state(cache_dtype)
        return other

    def stored_weight(self, t: Tensor, weights: dict[str, torch.Tensor]
                      ) -> torch.Tensor | BlockScaled:
        """Weight `t` on the device as stored: an FP8 weight with its block scales."""
        w = checked_weight(t, weights).to(self.device)
        if "scale_inv" not in t.attrs:
            return w
        scale = checked_weight(self.graph.tensors[t.attrs["scale_inv"]], weights)
        return BlockScaled(w, scale.to(self.device), tuple(t.attrs["block"]))

    def weight(self, name: str) -> torch.Tensor:
        """Weight tensor `name` as the model means it, in the interpreter's dtype (FP8 weights
        dequantized with their block scales)."""
        return self.params[name].to(self.dtype)

    def run(self, tokens: torch.Tensor, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """Run the graph over tokens [T] at positions [T]; returns every tensor computed (and
        the caches), not the weights."""
        step = Step(positions.to(self.device), self.state, self.dtype)
        env: dict[str, Any] = {"token": tokens.to(self.device), "pos": step.positions,
                               **self.state}

        def value(name: str, widen: bool) -> Any:
            if name not in self.params:
                return env[name]
            return self.params[name].to(self.dtype) if widen else self.params[name]

        for op in self.graph.ops():
            widen = op.opcode not in OWN_WIDENING
            ins = [value(i, widen) for i in op.inputs if i not in self.scales]
            outs = SEMANTICS[op.opcode](op, ins, step)
            env.update(zip(op.outputs, outs, strict=True))
        return env
