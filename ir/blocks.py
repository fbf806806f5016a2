"""The blocks a decoder layer is made of: attention (GQA) and feed-forward (dense SwiGLU).

Each block takes the residual stream tensor and returns the new one. Weight tensor names are
`layers.{i}.<hf suffix>` and carry the full Hugging Face key in `hf_name`. Families with other
blocks (MLA, DSA, MoE) add them in their own modules and are dispatched from here.
"""

from __future__ import annotations

from tilertc.ir.build import ACT, W, rope_attrs
from tilertc.ir.fp8 import scale_shape
from tilertc.ir.graph import Graph, TensorKind
from tilertc.model_specs.spec import ModelSpec


def weight(g: Graph, layer: int, suffix: str, shape: tuple[int, ...], dtype: str = "bf16",
           param: str | None = "weight") -> str:
    """Declare `layers.{layer}.{suffix}`, Hugging Face key `model.layers.{layer}.{suffix}.{param}`
    (`param=None` for keys that end in the suffix itself, such as biases)."""
    hf = f"model.layers.{layer}.{suffix}" + (f".{param}" if param else "")
    return g.tensor(f"layers.{layer}.{suffix}", shape, dtype, W, hf)


def projection_weight(g: Graph, layer: int, suffix: str, shape: tuple[int, int]) -> list[str]:
    """The op inputs that carry the projection weight `layers.{layer}.{suffix}` [out, in].

    In a bf16 model that is the weight alone. In an FP8 model (`weight_format` in the graph's
    attrs) it is the e4m3 weight followed by its fp32 block scales `{suffix}.weight_scale_inv`
    (Hugging Face key `model.layers.{layer}.{suffix}.weight_scale_inv`), which the weight names
    in its attrs (`scale_inv`, `block`); the interpreter hands ops the dequantized weight.
    """
    fmt = g.attrs["weight_format"]
    w = weight(g, layer, suffix, shape, fmt["dtype"])
    if fmt["dtype"] == "bf16":
        return [w]
    block = tuple(fmt["block"])
    scale = weight(g, layer, f"{suffix}.weight_scale_inv", scale_shape(shape, block), "fp32",
                   param=None)
    g.tensors[w].attrs.update(scale_inv=scale, block=list(block))
    return [w, scale]


def act(g: Graph, layer: int, name: str, shape: tuple[int, ...], dtype: str = "fp32") -> str:
    return g.tensor(f"layers.{layer}.{name}", shape, dtype, ACT)


def projection(g: Graph, layer: int, suffix: str, x: str, out: str, out_features: int,
               bias: bool = False, op: str | None = None, quantized: bool = True) -> str:
    """`layers.{layer}.{out}` = x · Wᵀ (+ b), W = `{suffix}` [out_features, in]: one `linear` op
    named `layers.{layer}.{op or out}`. `quantized=False` keeps W bf16 in an FP8 model, as the
    checkpoints do for a few small projections."""
    shape = (out_features, g.tensors[x].shape[-1])
    ins = [x, *(projection_weight(g, layer, suffix, shape) if quantized
                else [weight(g, layer, suffix, shape)])]
    if bias:
        ins.append(weight(g, layer, f"{suffix}.bias", (out_features,), param=None))
    y = act(g, layer, out, (out_features,))
    g.add(f"layers.{layer}.{op or out}", "linear", ins, [y], layer=layer)
    return y


def rotate(g: Graph, layer: int, x: str, out: str, n_heads: int, head_dim: int, rope: dict,
           rotary_offset: int = 0, rotary_dim: int | None = None) -> str:
    """RoPE on dims [rotary_offset, rotary_offset + rotary_dim) of each of `n_heads` heads of
    `x` (all of them by default); op and output are named `layers.{layer}.{out}`."""
    y = act(g, layer, out, (n_heads * head_dim,))
    g.add(f"layers.{layer}.{out}", "rope", [x, "pos"], [y], layer=layer, n_heads=n_heads,
          head_dim=head_dim, rotary_offset=rotary_offset,
          rotary_dim=head_dim - rotary_offset if rotary_dim is None else rotary_dim, rope=rope)
    return y


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


def input_norm(g: Graph, spec: ModelSpec, layer: int, x: str) -> str:
    ln = weight(g, layer, "input_layernorm", (spec.hidden_size,))
    xn = act(g, layer, "attn_in", (spec.hidden_size,))
    g.add(f"layers.{layer}.input_norm", "rms_norm", [x, ln], [xn], layer=layer,
          eps=spec.rms_norm_eps)
    return xn


def gqa_attention_block(g: Graph, spec: ModelSpec, layer: int, x: str, seq: int) -> str:
    nh, nkv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    i = layer
    xn = input_norm(g, spec, i, x)
    proj = {p: projection(g, i, f"self_attn.{p}_proj", xn, p, heads * hd, spec.attention_bias,
                          op=f"{p}_proj")
            for p, heads in (("q", nh), ("k", nkv), ("v", nkv))}
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
    return attention_output(g, spec, i, x, o)


def attention_output(g: Graph, spec: ModelSpec, layer: int, x: str, o: str) -> str:
    """The residual stream after attention: x + o_proj(o)."""
    y = projection(g, layer, "self_attn.o_proj", o, "attn_proj", spec.hidden_size,
                   spec.attention_bias, op="o_proj")
    x2 = act(g, layer, "x.attn", (spec.hidden_size,))
    g.add(f"layers.{layer}.attn_residual", "add", [x, y], [x2], layer=layer)
    return x2


def swiglu(g: Graph, layer: int, prefix: str, xn: str, hidden: int, inter: int) -> str:
    """down(silu(gate(xn)) * up(xn)) with weights `{prefix}.{gate,up,down}_proj`."""
    i = layer
    tag = prefix.replace("mlp", "ffn")
    gw = projection_weight(g, i, f"{prefix}.gate_proj", (inter, hidden))
    uw = projection_weight(g, i, f"{prefix}.up_proj", (inter, hidden))
    dw = projection_weight(g, i, f"{prefix}.down_proj", (hidden, inter))
    gate, up = act(g, i, f"{tag}.gate", (inter,)), act(g, i, f"{tag}.up", (inter,))
    g.add(f"layers.{i}.{tag}.gate_proj", "linear", [xn, *gw], [gate], layer=i)
    g.add(f"layers.{i}.{tag}.up_proj", "linear", [xn, *uw], [up], layer=i)
    hid = act(g, i, f"{tag}.act", (inter,))
    g.add(f"layers.{i}.{tag}.silu_mul", "silu_mul", [gate, up], [hid], layer=i)
    y = act(g, i, f"{tag}.out", (hidden,))
    g.add(f"layers.{i}.{tag}.down_proj", "linear", [hid, *dw], [y], layer=i)
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
