"""The Hugging Face config frontend: `config.json` dict -> validated `ModelSpec`.

Every error names the field and where the config came from, so that a user who brings their own
config knows what to fix.
"""

from __future__ import annotations

from typing import Any

from tilertc.model_specs.spec import (
    SUPPORTED_MODEL_TYPES,
    IndexerSpec,
    MLASpec,
    ModelSpec,
    MoESpec,
    RopeSpec,
    SpecError,
    WeightFormat,
)
from tilertc.model_specs.validate import validate


class ConfigReader:
    """Typed access to a config dict; errors name the field and the source."""

    def __init__(self, cfg: dict[str, Any], source: str) -> None:
        self.cfg, self.source = cfg, source

    def error(self, field: str, msg: str) -> SpecError:
        return SpecError(f"{self.source}: field {field!r}: {msg}")

    def get(self, field: str, kind: type, default: Any = ..., positive: bool = False) -> Any:
        if field not in self.cfg or self.cfg[field] is None:
            if default is ...:
                raise self.error(field, "required but missing")
            return default
        v = self.cfg[field]
        if kind is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if kind is int and isinstance(v, float) and v.is_integer():
            v = int(v)
        if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
            raise self.error(field, f"expected {kind.__name__}, got {v!r}")
        if positive and v <= 0:
            raise self.error(field, f"must be positive, got {v!r}")
        return v


def rope_from_config(r: ConfigReader, interleaved: bool = False) -> RopeSpec:
    """RoPE from `rope_theta` + `rope_scaling`, or from the newer `rope_parameters` dict."""
    params = r.cfg.get("rope_parameters") or {}
    scaling = r.cfg.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise r.error("rope_parameters" if params else "rope_scaling", "expected a JSON object")
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", r.cfg.get("rope_theta"))
    if theta is None:
        raise r.error("rope_theta", "required but missing (also not in rope_parameters)")
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind not in ("default", "llama3", "yarn"):
        raise r.error("rope_scaling.rope_type", f"unsupported RoPE type {kind!r} "
                      "(supported: default, llama3, yarn)")
    sub = ConfigReader(merged, f"{r.source} (rope parameters)")
    kw: dict[str, Any] = {"theta": float(theta), "rope_type": kind, "interleaved": interleaved}
    if kind in ("llama3", "yarn"):
        kw["factor"] = sub.get("factor", float, positive=True)
        kw["original_max_position_embeddings"] = sub.get("original_max_position_embeddings", int,
                                                         positive=True)
    if kind == "llama3":
        kw["low_freq_factor"] = sub.get("low_freq_factor", float, 1.0)
        kw["high_freq_factor"] = sub.get("high_freq_factor", float, 4.0)
    if kind == "yarn":
        kw["beta_fast"] = sub.get("beta_fast", float, 32.0)
        kw["beta_slow"] = sub.get("beta_slow", float, 1.0)
        # 0 = absent: transformers then uses the plain YaRN factor even if mscale_all_dim is set.
        kw["mscale"] = sub.get("mscale", float, 0.0)
        kw["mscale_all_dim"] = sub.get("mscale_all_dim", float, 0.0)
    return RopeSpec(**kw)


FP8_BLOCK = (128, 128)


def weight_format(r: ConfigReader) -> WeightFormat:
    """The projection weights' format from `quantization_config` (absent: bf16).

    Supported is the DeepSeek-V3 checkpoint format (transformers' "fine-grained FP8"): e4m3
    weights with an fp32 `weight_scale_inv` per 128x128 block, activations quantized on the fly
    (`activation_scheme` "dynamic", which the interpreter does not simulate: it computes in
    fp32). Any family may opt in by overriding `quantization_config`.
    """
    q = r.cfg.get("quantization_config")
    if q is None:
        return WeightFormat()
    if not isinstance(q, dict):
        raise r.error("quantization_config", f"expected a JSON object, got {q!r}")
    checks = (("quant_method", None, "fp8"), ("fmt", "e4m3", "e4m3"),
              ("activation_scheme", "dynamic", "dynamic"))
    for key, default, supported in checks:
        v = q.get(key, default)
        if v != supported:
            raise r.error(f"quantization_config.{key}",
                          f"unsupported value {v!r} (supported: {supported!r})")
    block = q.get("weight_block_size", list(FP8_BLOCK))
    if not isinstance(block, (list, tuple)) or tuple(block) != FP8_BLOCK:
        raise r.error("quantization_config.weight_block_size",
                      f"only 128x128 blocks are supported, got {block!r}")
    scale_fmt = q.get("scale_fmt")
    if scale_fmt not in (None, "ue8m0"):
        raise r.error("quantization_config.scale_fmt",
                      f"unsupported scale format {scale_fmt!r} (supported: ue8m0 or absent)")
    if q.get("modules_to_not_convert") not in (None, [], ["lm_head"]):
        raise r.error("quantization_config.modules_to_not_convert",
                      "only the default set of bf16 modules (embeddings, norms, routers, "
                      f"lm_head) is supported, got {q['modules_to_not_convert']!r}")
    return WeightFormat("fp8_e4m3", FP8_BLOCK, scale_fmt)


WEIGHT_DTYPES = ("bf16", "fp8")
# The quantization_config of a DeepSeek-V3-style FP8 checkpoint, as `weight_format` reads it.
FP8_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": list(FP8_BLOCK)}


def with_weight_dtype(spec: ModelSpec, dtype: str | None) -> ModelSpec:
    """`spec` with its projection weights in `dtype`: "fp8" gives its config the FP8
    quantization_config above (a config that already has one keeps it), "bf16" drops it, None
    keeps the config's own format. The change is made to the config and parsed again, so the
    result is the spec of that config (the artifact keeps the config and rebuilds from it)."""
    if dtype not in (None, *WEIGHT_DTYPES):
        raise SpecError(f"weight dtype {dtype!r} is not one of {', '.join(WEIGHT_DTYPES)}")
    if dtype is None or (dtype == "fp8") == spec.weight_format.is_fp8:
        return spec
    cfg = {k: v for k, v in spec.hf_config.items() if k != "quantization_config"}
    if dtype == "fp8":
        cfg["quantization_config"] = dict(FP8_QUANTIZATION)
    return spec_from_hf_config(cfg, spec.name, f"{spec.name} with {dtype} weights")


def dense_fields(r: ConfigReader) -> dict[str, Any]:
    """Fields every family shares (their consistency is checked by `validate`)."""
    h = r.get("hidden_size", int, positive=True)
    nh = r.get("num_attention_heads", int, positive=True)
    nkv = r.get("num_key_value_heads", int, nh, positive=True)
    return {
        "hidden_size": h,
        "num_layers": r.get("num_hidden_layers", int, positive=True),
        "num_heads": nh,
        "num_kv_heads": nkv,
        "intermediate_size": r.get("intermediate_size", int, positive=True),
        "vocab_size": r.get("vocab_size", int, positive=True),
        "rms_norm_eps": r.get("rms_norm_eps", float, 1e-6, positive=True),
        "max_position_embeddings": r.get("max_position_embeddings", int, 4096, positive=True),
        "tie_word_embeddings": r.get("tie_word_embeddings", bool, False),
        "attention_bias": r.get("attention_bias", bool, False),
        "weight_format": weight_format(r),
    }


def head_dim(r: ConfigReader, hidden: int, heads: int) -> int:
    """`head_dim` if given; otherwise hidden / heads, which must divide."""
    if r.cfg.get("head_dim") is not None:
        return r.get("head_dim", int, positive=True)
    if hidden % heads:
        raise r.error("num_attention_heads", f"{heads} does not divide hidden_size {hidden} "
                      "and no head_dim is given")
    return hidden // heads


def parse_llama(r: ConfigReader, name: str) -> ModelSpec:
    f = dense_fields(r)
    if r.cfg.get("mlp_bias"):
        raise r.error("mlp_bias", "MLP biases are not supported")
    hd = head_dim(r, f["hidden_size"], f["num_heads"])
    return ModelSpec(name=name, model_type=r.cfg["model_type"], head_dim=hd,
                     rope=rope_from_config(r), hf_config=dict(r.cfg), **f)


def parse_qwen3(r: ConfigReader, name: str) -> ModelSpec:
    f = dense_fields(r)
    hd = head_dim(r, f["hidden_size"], f["num_heads"])
    return ModelSpec(name=name, model_type="qwen3", head_dim=hd, qk_norm=True,
                     rope=rope_from_config(r), hf_config=dict(r.cfg), **f)


def int_list(r: ConfigReader, field: str) -> tuple[int, ...]:
    """A list of integers such as layer indices; empty when absent."""
    v = r.get(field, list, [])
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        raise r.error(field, f"expected a list of integers, got {v!r}")
    return tuple(v)


def layer_names(r: ConfigReader, field: str, allowed: tuple[str, ...], length: int,
                letters: dict[str, str] | None = None) -> list[str]:
    """A per-layer list of names drawn from `allowed` (or a string of one letter per layer)."""
    v = r.cfg[field]
    if isinstance(v, str) and letters:
        v = [letters.get(c, c) for c in v]
    if not isinstance(v, list) or len(v) != length or any(t not in allowed for t in v):
        raise r.error(field, f"expected {length} entries (one per layer) from {allowed}, "
                      f"got {r.cfg[field]!r}")
    return v


def parse_qwen3_moe(r: ConfigReader, name: str) -> ModelSpec:
    """Qwen3 attention (qk-norm) with a softmax-routed MoE and no shared expert."""
    f = dense_fields(r)
    if r.get("use_sliding_window", bool, False):
        raise r.error("use_sliding_window", "sliding-window attention is not supported")
    moe = MoESpec(
        num_experts=r.get("num_experts", int, positive=True),
        experts_per_token=r.get("num_experts_per_tok", int, positive=True),
        moe_intermediate_size=r.get("moe_intermediate_size", int, positive=True),
        scoring="softmax",
        norm_topk_prob=r.get("norm_topk_prob", bool, False),  # the transformers default
        sparse_step=r.get("decoder_sparse_step", int, 1, positive=True),
        mlp_only_layers=int_list(r, "mlp_only_layers"),
    )
    hd = head_dim(r, f["hidden_size"], f["num_heads"])
    return ModelSpec(name=name, model_type="qwen3_moe", head_dim=hd, qk_norm=True,
                     rope=rope_from_config(r), moe=moe, hf_config=dict(r.cfg), **f)


def mla_from_config(r: ConfigReader) -> MLASpec:
    # transformers' default for an absent q_lora_rank is 1536, so only an explicit null means
    # "no q LoRA"; asking for the key avoids guessing.
    if "q_lora_rank" not in r.cfg:
        raise r.error("q_lora_rank", "required but missing (null for a plain q_proj)")
    return MLASpec(
        q_lora_rank=r.get("q_lora_rank", int, None, positive=True),
        kv_lora_rank=r.get("kv_lora_rank", int, positive=True),
        qk_nope_head_dim=r.get("qk_nope_head_dim", int, positive=True),
        qk_rope_head_dim=r.get("qk_rope_head_dim", int, positive=True),
        v_head_dim=r.get("v_head_dim", int, positive=True),
    )


def dense_mlp_layers(r: ConfigReader, num_layers: int,
                     per_layer_types: bool) -> tuple[int, tuple[int, ...]]:
    """(leading dense layers, other dense layers) of a DeepSeek-style model.

    DeepSeek-V3 has `first_k_dense_replace`; DeepSeek-V3.2 and GLM-MoE-DSA may instead list
    `mlp_layer_types` ("dense" / "sparse" per layer), which then wins, as in transformers.
    """
    k = r.get("first_k_dense_replace", int, 3)
    if k < 0:
        raise r.error("first_k_dense_replace", f"must not be negative, got {k}")
    if not per_layer_types or r.cfg.get("mlp_layer_types") is None:
        return min(k, num_layers), ()
    types = layer_names(r, "mlp_layer_types", ("dense", "sparse"), num_layers)
    lead = next((i for i, t in enumerate(types) if t == "sparse"), num_layers)
    return lead, tuple(i for i in range(lead, num_layers) if types[i] == "dense")


def deepseek_moe_from_config(r: ConfigReader, num_layers: int, per_layer_types: bool) -> MoESpec:
    """The DeepSeek-V3 router (sigmoid, correction bias, group-limited top-k) and experts."""
    for field, supported in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        v = r.get(field, str, supported)
        if v != supported:
            raise r.error(field, f"{v!r} is not supported (this family routes with {supported!r})")
    first_dense, other_dense = dense_mlp_layers(r, num_layers, per_layer_types)
    return MoESpec(
        num_experts=r.get("n_routed_experts", int, positive=True),
        experts_per_token=r.get("num_experts_per_tok", int, positive=True),
        moe_intermediate_size=r.get("moe_intermediate_size", int, positive=True),
        num_shared_experts=r.get("n_shared_experts", int, 1),
        scoring="sigmoid",
        norm_topk_prob=r.get("norm_topk_prob", bool, True),
        routed_scaling_factor=r.get("routed_scaling_factor", float, 2.5, positive=True),
        n_group=r.get("n_group", int, positive=True),
        topk_group=r.get("topk_group", int, positive=True),
        has_correction_bias=True,
        first_dense_layers=first_dense,
        mlp_only_layers=other_dense,
    )


def indexer_from_config(r: ConfigReader, rope_interleaved: bool,
                        shared_layers: tuple[int, ...] = ()) -> IndexerSpec:
    return IndexerSpec(
        n_heads=r.get("index_n_heads", int, positive=True),
        head_dim=r.get("index_head_dim", int, positive=True),
        topk=r.get("index_topk", int, positive=True),
        rope_interleaved=rope_interleaved,
        shared_layers=shared_layers,
    )


def glm_shared_indexer_layers(r: ConfigReader, num_layers: int) -> tuple[int, ...]:
    """Layers that reuse an earlier layer's top-k: from `indexer_types`, else
    `index_topk_pattern` ("F"/"S" per layer), else `index_topk_freq` and
    `index_skip_topk_offset`, as `GlmMoeDsaConfig` derives them."""
    modes = ("full", "shared")
    if r.cfg.get("indexer_types") is not None:
        field, types = "indexer_types", layer_names(r, "indexer_types", modes, num_layers)
    elif r.cfg.get("index_topk_pattern") is not None:
        field = "index_topk_pattern"
        types = layer_names(r, field, modes, num_layers, {"F": "full", "S": "shared"})
    else:
        field = "index_topk_freq"
        freq = max(r.get("index_topk_freq", int, 1), 1)
        offset = r.get("index_skip_topk_offset", int, 2)
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared"
                 for i in range(num_layers)]
    if types[0] != "full":
        raise r.error(field, "layer 0 must run its own indexer (there is no earlier top-k)")
    return tuple(i for i, t in enumerate(types) if t == "shared")


def mla_moe_spec(r: ConfigReader, name: str, rope_interleaved: bool, per_layer_types: bool,
                 indexer: IndexerSpec | None = None) -> ModelSpec:
    """A DeepSeek-style model: MLA attention (optionally DSA-sparse), DeepSeek MoE.

    `head_dim` is the q/k head width (nope + rope); `num_kv_heads` stays the config's value
    although, in the absorbed decode form, every head reads the one shared latent cache.
    """
    f = dense_fields(r)
    mla = mla_from_config(r)
    return ModelSpec(name=name, model_type=r.cfg["model_type"], head_dim=mla.qk_head_dim,
                     rope=rope_from_config(r, interleaved=rope_interleaved), mla=mla,
                     indexer=indexer,
                     moe=deepseek_moe_from_config(r, f["num_layers"], per_layer_types),
                     hf_config=dict(r.cfg), **f)


def parse_deepseek_v3(r: ConfigReader, name: str) -> ModelSpec:
    return mla_moe_spec(r, name, rope_interleaved=r.get("rope_interleave", bool, True),
                        per_layer_types=False)


def parse_deepseek_v32(r: ConfigReader, name: str) -> ModelSpec:
    # transformers' DeepSeek-V3.2 always rotates the MLA RoPE in interleaved pairs (it ignores
    # `rope_interleave`) and its indexer in halves, as the fixed reference release does.
    return mla_moe_spec(r, name, rope_interleaved=True, per_layer_types=True,
                        indexer=indexer_from_config(r, rope_interleaved=False))


def parse_glm_moe_dsa(r: ConfigReader, name: str) -> ModelSpec:
    # GLM-5 rotates both the MLA and the indexer RoPE in interleaved pairs.
    layers = r.get("num_hidden_layers", int, positive=True)
    indexer = indexer_from_config(r, rope_interleaved=True,
                                  shared_layers=glm_shared_indexer_layers(r, layers))
    return mla_moe_spec(r, name, rope_interleaved=True, per_layer_types=True, indexer=indexer)


PARSERS = {
    "llama": parse_llama,
    "qwen3": parse_qwen3,
    "qwen3_moe": parse_qwen3_moe,
    "deepseek_v3": parse_deepseek_v3,
    "deepseek_v32": parse_deepseek_v32,
    "glm_moe_dsa": parse_glm_moe_dsa,
}


def spec_from_hf_config(cfg: dict[str, Any], name: str | None = None,
                        source: str = "config") -> ModelSpec:
    """Validate a Hugging Face config dict and turn it into a `ModelSpec`."""
    if not isinstance(cfg, dict):
        raise SpecError(f"{source}: expected a JSON object, got {type(cfg).__name__}")
    r = ConfigReader(cfg, source)
    mt = cfg.get("model_type")
    if mt is None:
        raise r.error("model_type", "required but missing "
                      f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if mt not in PARSERS:
        raise r.error("model_type", f"unsupported model type {mt!r} "
                      f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    return validate(PARSERS[mt](r, name or cfg.get("_name_or_path") or mt), source)
