"""The blocks a decoder layer is made of: attention (GQA) and feed-forward (dense SwiGLU).

Each block takes the residual stream tensor and returns the new one. Weight tensor names are
`layers.{i}.<hf suffix>` and carry the full Hugging Face key in `hf_name`. Families with other
blocks (MLA, DSA, MoE) add them in their own modules and are dispatched from here.
"""

from __future__ import annotations

from tilertc.ir.build import ACT, W, rope_attrs
from tilertc.ir.graph import Graph, TensorKind
from tilertc.model_specs.spec import ModelSpec


def weight(g: Graph, layer: int, suffix: str, shape: tuple[int, ...], dtype: str = "bf16",
           param: str | None = "weight") -> str:
    """Declare `layers.{layer}.{suffix}`, Hugging Face key `model.layers.{layer}.{suffix}.{param}`
    (`param=None` for keys that end in the suffix itself, such as biases)."""
    hf = f"model.layers.{layer}.{suffix}" + (f".{param}" if param else "")
    return g.tensor(f"layers.{layer}.{suffix}", shape, dtype, W, hf)


def act(g: Graph, layer: int, name: str, shape: tuple[int, ...], dtype: str = "fp32") -> str:
    return g.tensor(f"layers.{layer}.{name}", shape, dtype, ACT)


def attention_block(g: Graph, spec: ModelSpec, layer: int, x: str, seq: int) -> str:
    if spec.mla is not None:
        from tilertc.ir.mla import mla_attention_block

        return mla_attention_block(g, spec, layer, x, seq)
    return gqa_attention_block(g, spec, layer, x, seq)


def ffn_block(g: Graph, spec: ModelSpec, layer: int, x: str) -> str:
    if spec.is_moe_layer(layer):
        from tilertc.ir.moe import moe_ffn_block

        return moe_ffn_block(g, spec, layer, x)
    return dense_ffn_block(g, spec, layer, x)


def gqa_attention_block(g: Graph, spec: ModelSpec, layer: int, x: str, seq: int) -> str:
    h, nh, nkv, hd = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
    i = layer
    ln = weight(g, i, "input_layernorm", (h,))
    xn = act(g, i, "attn_in", (h,))
    g.add(f"layers.{i}.input_norm", "rms_norm", [x, ln], [xn], layer=i, eps=spec.rms_norm_eps)
    proj = {}
    for p, heads in (("q", nh), ("k", nkv), ("v", nkv)):
        w = weight(g, i, f"self_attn.{p}_proj", (heads * hd, h))
        ins = [xn, w]
        if spec.attention_bias:
            ins.append(weight(g, i, f"self_attn.{p}_proj.bias", (heads * hd,), param=None))
        proj[p] = act(g, i, f"{p}", (heads * hd,))
        g.add(f"layers.{i}.{p}_proj", "linear", ins, [proj[p]], layer=i)
    q, k = proj["q"], proj["k"]
    if spec.qk_norm:
        for p, heads in (("q", nh), ("k", nkv)):
            w = weight(g, i, f"self_attn.{p}_norm", (hd,))
            out = act(g, i, f"{p}_normed", (heads * hd,))
            g.add(f"layers.{i}.{p}_norm", "head_rms_norm", [proj[p], w], [out], layer=i,
                  n_heads=heads, head_dim=hd, eps=spec.rms_norm_eps)
            proj[p] = out
    for p, heads in (("q", nh), ("k", nkv)):
        out = act(g, i, f"{p}_rope", (heads * hd,))
        g.add(f"layers.{i}.{p}_rope", "rope", [proj[p], "pos"], [out], layer=i,
              n_heads=heads, head_dim=hd, rope=rope_attrs(spec))
        proj[p] = out
    q, k = proj["q"], proj["k"]
    kc = g.tensor(f"layers.{i}.k_cache", (seq, nkv, hd), "bf16", TensorKind.KV_CACHE)
    vc = g.tensor(f"layers.{i}.v_cache", (seq, nkv, hd), "bf16", TensorKind.KV_CACHE)
    g.add(f"layers.{i}.kv_append", "kv_append", [k, proj["v"], "pos"], [kc, vc], layer=i)
    o = act(g, i, "attn_out", (nh * hd,))
    g.add(f"layers.{i}.attention", "attention", [q, kc, vc, "pos"], [o], layer=i,
          n_heads=nh, n_kv_heads=nkv, head_dim=hd, scale=hd ** -0.5)
    wo = weight(g, i, "self_attn.o_proj", (h, nh * hd))
    y = act(g, i, "attn_proj", (h,))
    g.add(f"layers.{i}.o_proj", "linear", [o, wo], [y], layer=i)
    x2 = act(g, i, "x.attn", (h,))
    g.add(f"layers.{i}.attn_residual", "add", [x, y], [x2], layer=i)
    return x2


def swiglu(g: Graph, layer: int, prefix: str, xn: str, hidden: int, inter: int) -> str:
    """down(silu(gate(xn)) * up(xn)) with weights `{prefix}.{gate,up,down}_proj`."""
    i = layer
    tag = prefix.replace("mlp", "ffn")
    gw = weight(g, i, f"{prefix}.gate_proj", (inter, hidden))
    uw = weight(g, i, f"{prefix}.up_proj", (inter, hidden))
    dw = weight(g, i, f"{prefix}.down_proj", (hidden, inter))
    gate, up = act(g, i, f"{tag}.gate", (inter,)), act(g, i, f"{tag}.up", (inter,))
    g.add(f"layers.{i}.{tag}.gate_proj", "linear", [xn, gw], [gate], layer=i)
    g.add(f"layers.{i}.{tag}.up_proj", "linear", [xn, uw], [up], layer=i)
    hid = act(g, i, f"{tag}.act", (inter,))
    g.add(f"layers.{i}.{tag}.silu_mul", "silu_mul", [gate, up], [hid], layer=i)
    y = act(g, i, f"{tag}.out", (hidden,))
    g.add(f"layers.{i}.{tag}.down_proj", "linear", [hid, dw], [y], layer=i)
    return y


def post_attention_norm(g: Graph, spec: ModelSpec, layer: int, x: str) -> str:
    h = spec.hidden_size
    ln = weight(g, layer, "post_attention_layernorm", (h,))
    xn = act(g, layer, "ffn_in", (h,))
    g.add(f"layers.{layer}.post_attn_norm", "rms_norm", [x, ln], [xn], layer=layer,
          eps=spec.rms_norm_eps)
    return xn


def residual(g: Graph, layer: int, x: str, y: str) -> str:
    out = act(g, layer, "x.ffn", (g.tensors[x].shape[0],))
    g.add(f"layers.{layer}.ffn_residual", "add", [x, y], [out], layer=layer)
    return out


def dense_ffn_block(g: Graph, spec: ModelSpec, layer: int, x: str) -> str:
    xn = post_attention_norm(g, spec, layer, x)
    y = swiglu(g, layer, "mlp", xn, spec.hidden_size, spec.intermediate_size)
    return residual(g, layer, x, y)
