"""A hand-written kernel-per-op decode step for dense Llama and Qwen3: the serving-engine stand-in.

Serving engines (vLLM, SGLang) decode at batch 1 by launching one library kernel per op from a
captured CUDA graph, over weights they fused at load time. This module does the same in plain
PyTorch so that the benchmark can run it beside tilertc on the same GPU without those engines
installed: Q, K and V projections are one weight and gate and up another (one cuBLAS GEMV
each), the KV cache is preallocated, and attention reads only the keys written so far (rounded up
to a bucket when captured in a graph, masked beyond the current position) as batched GEMVs per
KV head. Elementwise ops stay unfused, so this stand-in launches more kernels per layer than
those engines do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tilertc.ir.build import rope_attrs
from tilertc.ir.rope import apply_rope, cos_sin
from tilertc.model_specs.spec import ModelSpec

SUPPORTED_FAMILIES = ("llama", "qwen3")
STACKED = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # each stack is a new tensor


def unsupported(spec: ModelSpec) -> str | None:
    """Why the kernel-per-op engine cannot run `spec`, or None."""
    if spec.model_type not in SUPPORTED_FAMILIES or not spec.is_dense:
        return (f"the kernel-per-op engine supports dense {SUPPORTED_FAMILIES}, "
                f"not {spec.model_type!r}")
    if spec.weight_format.is_fp8:
        return ("the kernel-per-op engine reads bf16 weights; this model's are FP8 "
                "(baselines.dequantized_model gives the bf16 model)")
    return None


def allocated_bytes(spec: ModelSpec, weights: dict[str, torch.Tensor], max_seq_len: int,
                    device: str | torch.device, dtype: torch.dtype) -> int:
    """What a KernelPerOpModel of `weights` allocates on `device`: its stacked projections, the
    weights it converts (a weight already there in `dtype` is used as it is) and its KV cache.
    Beside a kernel's packed copy of a large model the stacks alone may not fit."""
    device, size = torch.device(device), dtype.itemsize

    def copied(name: str, w: torch.Tensor) -> bool:
        return (w.device.type != device.type or w.dtype != dtype
                or any(f".{s}." in name for s in STACKED))

    cache = 2 * spec.num_layers * spec.num_kv_heads * max_seq_len * spec.head_dim
    return size * (cache + sum(w.numel() for n, w in weights.items() if copied(n, w)))


class _WeightLoader:
    """Hugging Face tensors moved to the device, stacking projections that read the same input."""

    def __init__(self, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype) -> None:
        self.weights, self.device, self.dtype = weights, device, dtype

    def one(self, name: str) -> torch.Tensor:
        return self.weights[name].to(self.device, self.dtype)

    def stacked(self, names: list[str]) -> torch.Tensor:
        """The named tensors concatenated along dim 0, so that one GEMV computes them all."""
        return torch.cat([self.one(n) for n in names])


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # q, k and v projections stacked: [(nh + 2 nkv) hd, h]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # Qwen3 per-head norms
    k_norm: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # gate and up projections stacked: [2 inter, h]
    down: torch.Tensor
    k_cache: torch.Tensor  # [nkv, max_seq_len, hd]
    v_cache: torch.Tensor


class KernelPerOpModel:
    """The decode step `step(token, pos, ctx_len) -> logits` over a static KV cache.

    `ctx_len` is how many cache rows attention reads; keys past `pos` are masked, so any
    `ctx_len > pos` gives the same result, which lets one CUDA graph serve a bucket of positions.
    """

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], max_seq_len: int,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                 ctx_bucket: int = 256) -> None:
        if why := unsupported(spec):
            raise ValueError(why)
        self.spec, self.device, self.dtype = spec, torch.device(device), dtype
        self.max_seq_len, self.ctx_bucket = max_seq_len, ctx_bucket

        load = _WeightLoader(weights, self.device, dtype)
        self.embed = load.one("model.embed_tokens.weight")
        self.norm = load.one("model.norm.weight")
        self.lm_head = self.embed if spec.tie_word_embeddings else load.one("lm_head.weight")
        self.layers = [self._layer(i, load) for i in range(spec.num_layers)]
        cos, sin = cos_sin(rope_attrs(spec), spec.head_dim, torch.arange(max_seq_len))
        self.cos, self.sin = cos.to(self.device, dtype), sin.to(self.device, dtype)
        self.key_positions = torch.arange(max_seq_len, device=self.device)

    def _layer(self, i: int, load: _WeightLoader) -> _Layer:
        s, p = self.spec, f"model.layers.{i}."
        attn = [f"{p}self_attn.{x}_proj" for x in "qkv"]
        cache_shape = (s.num_kv_heads, self.max_seq_len, s.head_dim)
        return _Layer(
            input_norm=load.one(p + "input_layernorm.weight"),
            qkv=load.stacked([a + ".weight" for a in attn]),
            qkv_bias=load.stacked([a + ".bias" for a in attn]) if s.attention_bias else None,
            q_norm=load.one(p + "self_attn.q_norm.weight") if s.qk_norm else None,
            k_norm=load.one(p + "self_attn.k_norm.weight") if s.qk_norm else None,
            o=load.one(p + "self_attn.o_proj.weight"),
            o_bias=load.one(p + "self_attn.o_proj.bias") if s.attention_bias else None,
            post_norm=load.one(p + "post_attention_layernorm.weight"),
            gate_up=load.stacked([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
            down=load.one(p + "mlp.down_proj.weight"),
            k_cache=torch.zeros(cache_shape, device=self.device, dtype=self.dtype),
            v_cache=torch.zeros(cache_shape, device=self.device, dtype=self.dtype),
        )

    def graph_ctx_len(self, ctx_len: int) -> int:
        """The attention length a CUDA graph serving contexts of `ctx_len` tokens is built with."""
        bucket = -(-ctx_len // self.ctx_bucket) * self.ctx_bucket
        return min(bucket, self.max_seq_len)

    def warmup(self, token: torch.Tensor, pos: torch.Tensor, ctx_len: int) -> None:
        """Run the step before graph capture; it writes only the cache row at `pos`, which the
        real step at that position overwrites."""
        self.step(token, pos, ctx_len)

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Fill the cache token by token; the logits [vocab] after the last one."""
        logits = None
        for p, token in enumerate(ids.to(self.device).reshape(-1, 1)):
            logits = self.step(token, torch.tensor([p], device=self.device), p + 1)
        if logits is None:
            raise ValueError("prefill needs at least one token")
        return logits

    def step(self, token: torch.Tensor, pos: torch.Tensor, ctx_len: int) -> torch.Tensor:
        """Logits [vocab] after `token` [1] at position `pos` [1], reading `ctx_len` cache rows."""
        s = self.spec
        eps, nh, nkv, hd = s.rms_norm_eps, s.num_heads, s.num_kv_heads, s.head_dim
        x = self.embed[token]  # [1, h]
        cos, sin = self.cos[pos], self.sin[pos]
        # Keys past the position get -inf before the softmax; added once per layer by baddbmm.
        mask = torch.zeros(1, 1, ctx_len, device=self.device, dtype=self.dtype)
        mask.masked_fill_(self.key_positions[:ctx_len] > pos, float("-inf"))
        for layer in self.layers:
            qkv = F.linear(F.rms_norm(x, (x.shape[-1],), layer.input_norm, eps), layer.qkv,
                           layer.qkv_bias)
            q, k, v = qkv.view(-1, hd).split([nh, nkv, nkv])
            if layer.q_norm is not None:
                q = F.rms_norm(q, (hd,), layer.q_norm, eps)
                k = F.rms_norm(k, (hd,), layer.k_norm, eps)
            q = apply_rope(q[None], cos, sin, s.rope.interleaved)[0]
            k = apply_rope(k[None], cos, sin, s.rope.interleaved)[0]
            layer.k_cache.index_copy_(1, pos, k[:, None])
            layer.v_cache.index_copy_(1, pos, v[:, None])
            # One batched GEMV per KV head over its group of query heads: no copy of the cache.
            keys, values = layer.k_cache[:, :ctx_len], layer.v_cache[:, :ctx_len]
            scores = torch.baddbmm(mask, q.view(nkv, nh // nkv, hd), keys.transpose(1, 2),
                                   alpha=hd ** -0.5)
            o = torch.bmm(scores.softmax(-1), values)
            x = x + F.linear(o.reshape(1, nh * hd), layer.o, layer.o_bias)
            gate, up = F.linear(F.rms_norm(x, (x.shape[-1],), layer.post_norm, eps),
                                layer.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down)
        return F.linear(F.rms_norm(x, (x.shape[-1],), self.norm, eps), self.lm_head)[0]
