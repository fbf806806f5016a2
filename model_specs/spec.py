"""The typed model description every later stage reads.

A `ModelSpec` holds exactly what the decode step of one model needs: dimensions, the attention
variant (GQA or MLA, with or without the DSA sparse indexer), the feed-forward variant (dense
SwiGLU or MoE), RoPE, norms. It is frozen and hashable so that it can key an artifact.
`hf_config` keeps the config dict it came from, so that tests can build the Hugging Face model
of the same architecture as an independent reference.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = (
    "llama",
    "qwen3",
    "qwen3_moe",
    "deepseek_v3",
    "deepseek_v32",
    "glm_moe_dsa",
)


class SpecError(ValueError):
    """A model description that cannot be compiled; the message names the field and the source."""


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    rope_type: str = "default"  # "default" | "llama3" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float = 1.0  # yarn
    mscale_all_dim: float = 0.0  # yarn
    # Interleaved RoPE rotates pairs (2i, 2i+1) as complex numbers; non-interleaved rotates
    # (i, i + d/2) ("rotate_half").
    interleaved: bool = False


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3 family)."""

    q_lora_rank: int | None  # None: q is a plain projection of the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class IndexerSpec:
    """The DSA lightning indexer that picks the top-k context tokens for sparse MLA."""

    n_heads: int
    head_dim: int
    topk: int
    rope_interleaved: bool = False
    # GLM-MoE-DSA cross-layer sharing: these layers run no indexer of their own and reuse the
    # top-k of the closest earlier layer that does (layer 0 always runs one).
    shared_layers: tuple[int, ...] = ()

    def runs_indexer(self, layer: int) -> bool:
        return layer not in self.shared_layers


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    experts_per_token: int
    moe_intermediate_size: int
    num_shared_experts: int = 0
    scoring: str = "softmax"  # "softmax" | "sigmoid"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    has_correction_bias: bool = False  # DeepSeek "noaux_tc": e_score_correction_bias
    first_dense_layers: int = 0  # DeepSeek first_k_dense_replace
    # Qwen3-MoE: a layer is MoE when (layer + 1) % sparse_step == 0 and it is not listed in
    # mlp_only_layers.
    sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def is_moe_layer(self, layer: int) -> bool:
        if layer < self.first_dense_layers or layer in self.mlp_only_layers:
            return False
        return (layer + 1) % self.sparse_step == 0


@dataclass(frozen=True)
class WeightFormat:
    """How the projection weights are stored.

    bf16, or FP8 e4m3 with one fp32 scale per `block` (rows, cols) of the weight, stored as the
    checkpoint's `weight_scale_inv` (DeepSeek-V3 style). Norms, embeddings, lm_head and routers
    stay bf16 either way. `scale_fmt` "ue8m0" means every scale is a power of two.
    """

    dtype: str = "bf16"  # "bf16" | "fp8_e4m3"
    block: tuple[int, int] | None = None  # FP8 only
    scale_fmt: str | None = None  # FP8 only: None (any fp32) | "ue8m0"

    @property
    def is_fp8(self) -> bool:
        return self.dtype == "fp8_e4m3"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense SwiGLU width (dense layers of MoE models too)
    vocab_size: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    attention_bias: bool = False
    mla: MLASpec | None = None
    indexer: IndexerSpec | None = None
    moe: MoESpec | None = None
    weight_format: WeightFormat = WeightFormat()
    # The config dict the spec came from (Hugging Face keys), kept for references and reports.
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def family(self) -> str:
        return self.model_type

    @property
    def is_dense(self) -> bool:
        return self.moe is None and self.mla is None

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe.is_moe_layer(layer)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("hf_config")
        return d

    def content_hash(self) -> str:
        """A stable hash of the architecture (not of the name or the source config's extras)."""
        d = self.to_dict()
        d.pop("name")
        blob = json.dumps(d, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]
