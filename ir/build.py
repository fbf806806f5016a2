"""Lower a `ModelSpec` into the op graph of one decode step.

The graph is written op by op the way the Hugging Face implementation of each family computes
it, with every weight named as in that family's checkpoints. One function per block kind; the
family decides which blocks a layer is made of.
"""

from __future__ import annotations

import dataclasses

from tilertc.ir.graph import Graph, TensorKind
from tilertc.model_specs.spec import ModelSpec

ACT = TensorKind.ACTIVATION
W = TensorKind.WEIGHT


def build_graph(spec: ModelSpec, max_seq_len: int | None = None) -> Graph:
    """The decode-step graph of `spec`, with KV caches sized for `max_seq_len` tokens."""
    from tilertc.ir import blocks  # family blocks register themselves there

    seq = int(max_seq_len or min(spec.max_position_embeddings, 4096))
    g = Graph(spec.name)
    g.attrs.update(model_type=spec.model_type, max_seq_len=seq, spec_hash=spec.content_hash(),
                   weight_format=dataclasses.asdict(spec.weight_format))
    h = spec.hidden_size
    g.tensor("token", (1,), "int64", TensorKind.INPUT)
    g.tensor("pos", (1,), "int64", TensorKind.INPUT)
    g.tensor("embed_tokens", (spec.vocab_size, h), "bf16", W, "model.embed_tokens.weight")
    x = g.tensor("x.embed", (h,), "fp32", ACT)
    g.add("embed", "embedding", ["token", "embed_tokens"], [x])
    for layer in range(spec.num_layers):
        x = blocks.attention_block(g, spec, layer, x, seq)
        x = blocks.ffn_block(g, spec, layer, x)
    xn = g.tensor("x.final_norm", (h,), "fp32", ACT)
    g.tensor("norm", (h,), "bf16", W, "model.norm.weight")
    g.add("final_norm", "rms_norm", [x, "norm"], [xn], eps=spec.rms_norm_eps)
    head_hf = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
    if spec.tie_word_embeddings:
        head = "embed_tokens"
    else:
        head = g.tensor("lm_head", (spec.vocab_size, h), "bf16", W, head_hf)
    g.tensor("logits", (spec.vocab_size,), "fp32", TensorKind.OUTPUT)
    g.add("lm_head", "linear", [xn, head], ["logits"])
    g.tensor("next_token", (1,), "int64", TensorKind.OUTPUT)
    g.add("sample", "argmax", ["logits"], ["next_token"])
    return g


def rope_attrs(spec: ModelSpec, **overrides: object) -> dict:
    """The RoPE description an op carries (a plain dict, so the graph serializes)."""
    return dataclasses.asdict(dataclasses.replace(spec.rope, **overrides))
