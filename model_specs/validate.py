"""Consistency checks on a parsed `ModelSpec`, shared by every family.

The family parsers read and type-check fields; these checks catch combinations that parse but
cannot describe a model (heads that do not group, more experts per token than experts, ...).
They run on the spec rather than on the config so that one set of rules covers every family,
and each error names the Hugging Face key a user would edit, with the config it came from.
"""

from __future__ import annotations

from tilertc.model_specs.spec import (
    SUPPORTED_MODEL_TYPES,
    IndexerSpec,
    MLASpec,
    ModelSpec,
    MoESpec,
    RopeSpec,
    SpecError,
)

# Spec field -> the Hugging Face config key it is read from (where the names differ).
HF_KEYS = {
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "experts_per_token": "num_experts_per_tok",
    "num_shared_experts": "n_shared_experts",
    "first_dense_layers": "first_k_dense_replace",
    "sparse_step": "decoder_sparse_step",
    "scoring": "scoring_func",
    "n_heads": "index_n_heads",
    "topk": "index_topk",
}


class Checker:
    """Collects the source so that each check is one line that names its HF key."""

    def __init__(self, spec: ModelSpec, source: str) -> None:
        self.spec, self.source = spec, source

    def key(self, field: str, section: str = "") -> str:
        if field == "num_experts":
            return "num_experts" if self.spec.model_type == "qwen3_moe" else "n_routed_experts"
        if section == "indexer" and field == "head_dim":
            return "index_head_dim"
        if section == "rope":
            new_style = "rope_parameters" in self.spec.hf_config
            where = "rope_parameters" if new_style else "rope_scaling"
            return f"{where}.{field}" if field != "theta" else "rope_theta"
        return HF_KEYS.get(field, field)

    def require(self, ok: bool, field: str, msg: str, section: str = "") -> None:
        if not ok:
            raise SpecError(f"{self.source}: field {self.key(field, section)!r}: {msg}")

    def positive(self, obj: object, fields: tuple[str, ...], section: str = "") -> None:
        for f in fields:
            v = getattr(obj, f)
            self.require(v is not None and v > 0, f, f"must be positive, got {v!r}", section)


def validate(spec: ModelSpec, source: str = "config") -> ModelSpec:
    """Raise `SpecError` naming the offending field if `spec` is inconsistent; return it if not."""
    c = Checker(spec, source)
    c.require(spec.model_type in SUPPORTED_MODEL_TYPES, "model_type",
              f"unsupported model type {spec.model_type!r} "
              f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    c.positive(spec, ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                      "intermediate_size", "vocab_size", "rms_norm_eps",
                      "max_position_embeddings"))
    c.require(spec.num_heads % spec.num_kv_heads == 0, "num_kv_heads",
              f"{spec.num_kv_heads} does not divide num_attention_heads {spec.num_heads}")
    rotary_dim = spec.mla.qk_rope_head_dim if spec.mla else spec.head_dim
    check_rope(c, spec.rope, rotary_dim)
    if spec.mla is not None:
        check_mla(c, spec.mla)
    if spec.indexer is not None:
        check_indexer(c, spec.indexer, spec.mla)
    if spec.moe is not None:
        check_moe(c, spec.moe)
    return spec


def check_rope(c: Checker, rope: RopeSpec, rotary_dim: int) -> None:
    c.positive(rope, ("theta", "factor"), "rope")
    dim_key = "qk_rope_head_dim" if c.spec.mla else "head_dim"
    c.require(rotary_dim % 2 == 0, dim_key,
              f"RoPE rotates pairs of dimensions, so it must be even, got {rotary_dim}")
    if rope.rope_type in ("llama3", "yarn"):
        c.positive(rope, ("original_max_position_embeddings",), "rope")
    if rope.rope_type == "llama3":
        c.require(rope.high_freq_factor > rope.low_freq_factor, "high_freq_factor",
                  f"must exceed low_freq_factor {rope.low_freq_factor}, "
                  f"got {rope.high_freq_factor}", "rope")


def check_mla(c: Checker, mla: MLASpec) -> None:
    c.positive(mla, ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    c.require(mla.q_lora_rank is None or mla.q_lora_rank > 0, "q_lora_rank",
              f"must be positive or null, got {mla.q_lora_rank!r}")


def check_indexer(c: Checker, ix: IndexerSpec, mla: MLASpec | None) -> None:
    c.require(mla is not None, "index_topk", "the DSA indexer needs MLA attention (kv_lora_rank)")
    c.positive(ix, ("n_heads", "head_dim", "topk"), "indexer")
    c.require(mla.q_lora_rank is not None, "q_lora_rank",
              "the DSA indexer reads the q-LoRA output, so q_lora_rank is required")
    c.require(ix.head_dim >= mla.qk_rope_head_dim, "head_dim",
              f"{ix.head_dim} is smaller than its RoPE part qk_rope_head_dim "
              f"{mla.qk_rope_head_dim}", "indexer")


def check_moe(c: Checker, moe: MoESpec) -> None:
    c.positive(moe, ("num_experts", "experts_per_token", "moe_intermediate_size", "n_group",
                     "topk_group", "sparse_step", "routed_scaling_factor"))
    e, k = moe.num_experts, moe.experts_per_token
    c.require(k <= e, "experts_per_token", f"{k} exceeds {c.key('num_experts')} {e}")
    c.require(moe.num_shared_experts >= 0, "num_shared_experts",
              f"must not be negative, got {moe.num_shared_experts}")
    c.require(moe.scoring in ("softmax", "sigmoid"), "scoring",
              f"unsupported router scoring {moe.scoring!r} (supported: softmax, sigmoid)")
    c.require(e % moe.n_group == 0, "n_group",
              f"{moe.n_group} does not divide {c.key('num_experts')} {e}")
    c.require(moe.topk_group <= moe.n_group, "topk_group",
              f"{moe.topk_group} exceeds n_group {moe.n_group}")
    per_group = e // moe.n_group
    c.require(k <= moe.topk_group * per_group, "experts_per_token",
              f"{k} experts cannot be chosen from topk_group {moe.topk_group} groups of "
              f"{per_group}")
    if moe.has_correction_bias and moe.n_group > 1:
        c.require(per_group >= 2, "n_group",
                  f"a group's score sums its top 2 experts, but {moe.n_group} groups of "
                  f"{e} experts hold {per_group} each")
    c.require(moe.first_dense_layers >= 0, "first_dense_layers",
              f"must not be negative, got {moe.first_dense_layers}")
