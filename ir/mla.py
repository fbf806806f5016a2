"""Multi-head latent attention (DeepSeek-V3 family) in the absorbed decode form.

The cache holds one row per token of kv_lora_rank + qk_rope_head_dim values, shared by all heads:
the normed latent c and the rotated key part k_pe. Keys and values are never expanded. Instead
the per-head key up-projection (the first qk_nope_head_dim rows of each head's block of
`kv_b_proj`) is absorbed into the query, q_lat[h] = q_nope[h] · W_uk[h], so that

    score[h, t] = (q_lat[h] · c[t] + q_pe[h] · k_pe[t]) · scale,    o_lat[h] = Σ_t p[h, t] c[t],

and the value up-projection (the other v_head_dim rows) is applied once to the attention output,
o[h] = W_uv[h] · o_lat[h]. This equals transformers' expanded computation up to float rounding
and reads kv_lora_rank + rope values per cached token instead of heads × (qk + v).

With DSA (DeepSeek-V3.2, GLM-5) the attention sees only the indexer's top-k tokens (`ir/dsa.py`).
"""

from __future__ import annotations

import math

import torch

from tilertc.ir.blocks import (
    act,
    attention_output,
    input_norm,
    projection,
    projection_weight,
    rotate,
    weight,
)
from tilertc.ir.build import rope_attrs
from tilertc.ir.dsa import dsa_selection, selection_mask
from tilertc.ir.fp8 import expand_blocks
from tilertc.ir.graph import Graph, Op, TensorKind
from tilertc.ir.interpreter import Step, causal_mask, semantics
from tilertc.ir.rope import yarn_mscale
from tilertc.model_specs.spec import ModelSpec

# transformers and the reference code build q_a_layernorm and kv_a_layernorm with the RMSNorm
# default eps, not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def mla_softmax_scale(spec: ModelSpec) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)² under YaRN (DeepSeek-V3)."""
    scale = spec.mla.qk_head_dim ** -0.5
    if spec.rope.rope_type != "default" and spec.rope.mscale_all_dim:
        scale *= yarn_mscale(spec.rope.factor, spec.rope.mscale_all_dim) ** 2
    return scale


def latent_norm(g: Graph, layer: int, suffix: str, x: str, out: str) -> str:
    w = weight(g, layer, suffix, g.tensors[x].shape)
    y = act(g, layer, out, g.tensors[x].shape)
    g.add(f"layers.{layer}.{out}_norm", "rms_norm", [x, w], [y], layer=layer,
          eps=LATENT_NORM_EPS)
    return y


def mla_attention_block(g: Graph, spec: ModelSpec, layer: int, x: str, seq: int) -> str:
    """x + o_proj(MLA(input_layernorm(x))), with the latent cache sized for `seq` tokens."""
    m, nh, i, bias = spec.mla, spec.num_heads, layer, spec.attention_bias
    r, nope, rope_dim = m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim
    dims = {"n_heads": nh, "kv_lora_rank": r, "qk_nope_head_dim": nope,
            "qk_rope_head_dim": rope_dim, "v_head_dim": m.v_head_dim}
    xn = input_norm(g, spec, i, x)
    q_resid = None
    if m.q_lora_rank is None:
        q = projection(g, i, "self_attn.q_proj", xn, "q", nh * m.qk_head_dim)
    else:
        q_a = projection(g, i, "self_attn.q_a_proj", xn, "q_a", m.q_lora_rank, bias)
        q_resid = latent_norm(g, i, "self_attn.q_a_layernorm", q_a, "q_resid")
        q = projection(g, i, "self_attn.q_b_proj", q_resid, "q", nh * m.qk_head_dim)
    q = rotate(g, i, q, "q_rope", nh, m.qk_head_dim, rope_attrs(spec), nope, rope_dim)

    kv_a = projection(g, i, "self_attn.kv_a_proj_with_mqa", xn, "kv_a", r + rope_dim, bias)
    latent, k_pe = act(g, i, "kv_latent_raw", (r,)), act(g, i, "k_pe", (rope_dim,))
    g.add(f"layers.{i}.kv_split", "split", [kv_a], [latent, k_pe], layer=i,
          sizes=(r, rope_dim))
    latent = latent_norm(g, i, "self_attn.kv_a_layernorm", latent, "kv_latent")
    k_pe = rotate(g, i, k_pe, "k_pe_rope", 1, rope_dim, rope_attrs(spec))
    cache = g.tensor(f"layers.{i}.kv_latent_cache", (seq, r + rope_dim), "bf16",
                     TensorKind.KV_CACHE)
    g.add(f"layers.{i}.kv_append", "mla_kv_append", [latent, k_pe, "pos"], [cache], layer=i)

    kv_b = projection_weight(g, i, "self_attn.kv_b_proj", (nh * (nope + m.v_head_dim), r))
    q_lat = act(g, i, "q_latent", (nh * r,))
    g.add(f"layers.{i}.q_absorb", "mla_absorb_q", [q, *kv_b], [q_lat], layer=i, **dims)
    attn_ins = [q_lat, q, cache, "pos"]
    if spec.indexer is not None:
        attn_ins.append(dsa_selection(g, spec, i, xn, q_resid, seq))
    o_lat = act(g, i, "o_latent", (nh * r,))
    g.add(f"layers.{i}.attention", "mla_attention", attn_ins, [o_lat], layer=i,
          scale=mla_softmax_scale(spec), **dims)
    o = act(g, i, "attn_out", (nh * m.v_head_dim,))
    g.add(f"layers.{i}.v_expand", "mla_expand_v", [o_lat, *kv_b], [o], layer=i, **dims)
    return attention_output(g, spec, i, x, o)


def kv_b_per_head(w: torch.Tensor, a: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """`kv_b_proj` [heads·(nope + v), rank] as W_uk [heads, nope, rank], W_uv [heads, v, rank]."""
    nope = a["qk_nope_head_dim"]
    per_head = w.reshape(a["n_heads"], nope + a["v_head_dim"], a["kv_lora_rank"])
    return per_head[:, :nope], per_head[:, nope:]


def derive_kv_b(w: torch.Tensor, kind: str, a: dict) -> torch.Tensor:
    """A weight the fused graph derives from `kv_b_proj` (passes/fusion_mla.py), as the
    runtime packs it: `w_uk_t` [heads·rank, nope] is each head's W_uk transposed, so that an
    output row of the q absorption (h, j) is the contiguous W_uk[h][:, j]; `w_uv`
    [heads·v, rank] is each head's W_uv."""
    w_uk, w_uv = kv_b_per_head(w, a)
    if kind == "w_uk_t":
        return w_uk.transpose(1, 2).reshape(-1, a["qk_nope_head_dim"]).contiguous()
    if kind == "w_uv":
        return w_uv.reshape(-1, a["kv_lora_rank"]).contiguous()
    raise ValueError(f"unknown derived weight {kind!r} of kv_b_proj")


def derived_scale_cols(kind: str, a: dict, block: tuple[int, int]) -> int:
    """The columns one packed scale covers in a row of an FP8 weight derived from `kv_b_proj`.

    A row of `w_uv` is a row of kv_b: the scales of its block row, one per block of columns.
    A row (h, r) of `w_uk_t` runs down kv_b's column r over its rows h·(nope + v) + j,
    j < nope, so its scale changes where that row index crosses a block row: at values of j
    that are multiples of gcd(block rows, nope + v) for every head (64 for GLM-5's 192 + 256
    rows per head, 128 for DeepSeek-V3's 128 + 128). One scale per that many columns keeps the
    row exact in FP8 at a few bytes per row."""
    if kind == "w_uv":
        return block[1]
    if kind == "w_uk_t":
        return math.gcd(block[0], a["qk_nope_head_dim"] + a["v_head_dim"])
    raise ValueError(f"unknown derived weight {kind!r} of kv_b_proj")


def derive_kv_b_scales(scale_inv: torch.Tensor, kind: str, a: dict,
                       block: tuple[int, int]) -> torch.Tensor:
    """The scales of each row of a derived FP8 weight (`derive_kv_b`) as packed: [rows,
    ceil(cols / derived_scale_cols)], from kv_b's `weight_scale_inv`. Every weight's scale is
    derived as the weight itself is, then one is kept per `derived_scale_cols` columns (all
    the columns it covers share it, by that function's choice)."""
    rows = a["n_heads"] * (a["qk_nope_head_dim"] + a["v_head_dim"])
    per_weight = derive_kv_b(expand_blocks(scale_inv.float(), (rows, a["kv_lora_rank"]), block),
                             kind, a)
    return per_weight[:, ::derived_scale_cols(kind, a, block)].contiguous()


def q_heads(q: torch.Tensor, a: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, heads·(nope + rope)] as q_nope [T, heads, nope] and q_pe [T, heads, rope]."""
    nope = a["qk_nope_head_dim"]
    per_head = q.reshape(q.shape[0], a["n_heads"], nope + a["qk_rope_head_dim"])
    return per_head[..., :nope], per_head[..., nope:]


@semantics("mla_kv_append")
def _mla_kv_append(op: Op, ins: list[torch.Tensor], step: Step) -> list[torch.Tensor]:
    latent, k_pe = ins[0], ins[1]
    cache = step.state[op.outputs[0]]
    cache[step.positions] = torch.cat((latent, k_pe), dim=-1).to(cache.dtype)
    return [cache]


@semantics("mla_absorb_q")
def _mla_absorb_q(op: Op, ins: list[torch.Tensor], step: Step) -> list[torch.Tensor]:
    q_nope, _ = q_heads(ins[0], op.attrs)
    w_uk, _ = kv_b_per_head(ins[1], op.attrs)
    return [torch.einsum("thd,hdr->thr", q_nope, w_uk).flatten(1)]


@semantics("mla_expand_v")
def _mla_expand_v(op: Op, ins: list[torch.Tensor], step: Step) -> list[torch.Tensor]:
    a = op.attrs
    o_lat = ins[0].reshape(ins[0].shape[0], a["n_heads"], a["kv_lora_rank"])
    _, w_uv = kv_b_per_head(ins[1], a)
    return [torch.einsum("thr,hvr->thv", o_lat, w_uv).flatten(1)]


@semantics("mla_attention")
def _mla_attention(op: Op, ins: list[torch.Tensor], step: Step) -> list[torch.Tensor]:
    """Inputs: q_lat, q (for its rope part), latent cache, pos[, DSA top-k token ids]."""
    a = op.attrs
    t, r = ins[0].shape[0], a["kv_lora_rank"]
    q_lat = ins[0].reshape(t, a["n_heads"], r)
    _, q_pe = q_heads(ins[1], a)
    n = int(step.positions.max()) + 1
    rows = ins[2][:n].to(step.dtype)
    latent, k_pe = rows[:, :r], rows[:, r:]
    scores = (torch.einsum("thr,nr->thn", q_lat, latent)
              + torch.einsum("thd,nd->thn", q_pe, k_pe)) * a["scale"]
    visible = causal_mask(step, n)
    if len(ins) > 4:
        visible = visible & selection_mask(ins[4], n)
    p = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1)
    return [torch.einsum("thn,nr->thr", p, latent).flatten(1)]
