"""The Hugging Face config frontend: `config.json` dict -> validated `ModelSpec`.

Every error names the field and where the config came from, so that a user who brings their own
config knows what to fix.
"""

from __future__ import annotations

from typing import Any

from tilertc.model_specs.spec import SUPPORTED_MODEL_TYPES, ModelSpec, RopeSpec, SpecError
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
        kw["mscale"] = sub.get("mscale", float, 1.0)
        kw["mscale_all_dim"] = sub.get("mscale_all_dim", float, 0.0)
    return RopeSpec(**kw)


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


PARSERS = {
    "llama": parse_llama,
    "qwen3": parse_qwen3,
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
