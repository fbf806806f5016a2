"""Fusion of absorbed MLA attention (DeepSeek-V3 family) and of the DSA indexer.

The input norm's projections (q_a or q, kv_a, the indexer's key and head weights) and the q_a
norm's (q_b, the indexer's queries) are `norm_matvec`s (fusion.py). What follows them in one
layer becomes, in this program order:

- `dsa_score` (DSA): the indexer's scores over the context, in chunks; the last chunk (which
  holds the current position) runs the key prologue (LayerNorm, RoPE) and appends the key.
- `dsa_topk` (DSA): the top-k token ids of the scores.
  The indexer comes first in program order: both it and the q absorption start when q_b is
  done, and its chain to attention (scores, then top-k) is the longer, so it takes the SMs it
  needs first and the q absorption the rest (tiling: `sms_beside`).
- `head_matvec` (q_absorb): q_latent[h] = q_nope[h]·W_uk[h], a matrix-vector product whose
  output rows (h, r) each read the head's own input against the rows of W_ukᵀ (derived weight
  `kv_b_proj.w_uk_t`, packed transposed at load time). Its first task also runs the latent
  prologue (split of kv_a, kv_a_layernorm, RoPE of k_pe) and appends the step's latent row to
  the cache, so that every attention chunk that follows finds it there: with DSA the current
  position can sit in any chunk of the top-k list, so no single chunk could own the append.
- `mla_attention`: chunked like GQA attention, by head group and by chunk of the context (of
  the top-k list with DSA); each chunk rotates its heads' q_pe and leaves its partial result.
- `head_matvec` (v_expand): o[h] = W_uv[h]·o_latent[h], rows of the derived `kv_b_proj.w_uv`;
  its tasks merge the attention's chunk results of their heads into o_latent[h] as they stage
  their input (`merges`), instead of the last chunk of each head group merging the group's:
  that merge read every chunk's 16 heads x 512 sums on one SM (0.5 MB, ~8.5 µs of a
  DeepSeek-V3.2 layer on the H200; GLM-5's 32 chunks twice that), where a v_expand task reads
  the chunks of its one or two heads.
"""

from __future__ import annotations

from tilertc.ir.graph import Op
from tilertc.ir.mla import derived_scale_cols
from tilertc.passes.fusion import Fusion

MLA_DIMS = ("n_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def fuse_mla(f: Fusion, first: Op) -> None:
    ops = [op for op in f.layers[first.layer] if op.name not in f.done]

    def one(opcode: str) -> Op:
        return next(op for op in ops if op.opcode == opcode)

    attn, absorb, expand = one("mla_attention"), one("mla_absorb_q"), one("mla_expand_v")
    append, split = one("mla_kv_append"), one("split")
    q_rope = f.writer[attn.inputs[1]]
    latent_norm, k_pe_rope = f.writer[append.inputs[0]], f.writer[append.inputs[1]]
    a = attn.attrs
    dims = {k: a[k] for k in MLA_DIMS}
    nh, r, nope = a["n_heads"], a["kv_lora_rank"], a["qk_nope_head_dim"]
    qk = nope + a["qk_rope_head_dim"]
    kv_b = absorb.inputs[1]
    w_uk_t, w_uv = (f.derived(kv_b, kind, shape, **_scale_cols(f, kv_b, kind, dims))
                    for kind, shape in (("w_uk_t", (nh * r, nope)),
                                        ("w_uv", (nh * a["v_head_dim"], r))))
    q, q_off = f.locate(q_rope.inputs[0])
    kv_a, kv_off = f.locate(split.inputs[0])
    cache = append.outputs[0]
    topk = attn.inputs[4] if len(attn.inputs) > 4 else None
    if any(op.opcode == "dsa_index_score" for op in ops):
        _fuse_dsa(f, ops)
    f.emit(absorb.name, "head_matvec", [q, w_uk_t, kv_a, latent_norm.inputs[1]],
           [absorb.outputs[0], cache], first.layer,
           [absorb, split, latent_norm, k_pe_rope, append], K=nope, rows=nh * r,
           rows_per_head=r, in_stride=qk, io={"x": [q, q_off], "kv_a": [kv_a, kv_off]},
           eps=latent_norm.attrs["eps"], **dims)
    f.emit(attn.name, "mla_attention", [absorb.outputs[0], q, cache, *([topk] if topk else [])],
           list(attn.outputs), first.layer, [q_rope, attn], io={"q": [q, q_off]},
           scale=a["scale"], rope=q_rope.attrs["rope"], dsa=topk is not None, **dims)
    f.emit(expand.name, "head_matvec", [expand.inputs[0], w_uv], list(expand.outputs),
           first.layer, [expand], K=r, rows=nh * a["v_head_dim"], rows_per_head=a["v_head_dim"],
           in_stride=r, io={"x": [expand.inputs[0], 0]}, merges=attn.name, **dims)


def _scale_cols(f: Fusion, kv_b: str, kind: str, dims: dict) -> dict[str, int]:
    """An FP8 derived weight's `scale_cols` (`ir/mla.py: derived_scale_cols`): its rows stay
    FP8, with one scale per that many columns; none for bf16."""
    w = f.g.tensors[kv_b]
    if "block" not in w.attrs:
        return {}
    return {"scale_cols": derived_scale_cols(kind, dims, tuple(w.attrs["block"]))}


def _fuse_dsa(f: Fusion, ops: list[Op]) -> None:
    score = next(op for op in ops if op.opcode == "dsa_index_score")
    topk = next(op for op in ops if op.opcode == "dsa_topk")
    q_rope = f.writer[score.inputs[0]]
    k_append = f.writer[score.inputs[2]]
    k_rope = f.writer[k_append.inputs[0]]
    k_norm = f.writer[k_rope.inputs[0]]
    io = {"q": list(f.locate(q_rope.inputs[0])), "k": list(f.locate(k_norm.inputs[0])),
          "w": list(f.locate(score.inputs[1]))}
    bases = list(dict.fromkeys(base for base, _ in io.values()))
    a = score.attrs
    f.emit(score.name, "dsa_score", [*bases, *k_norm.inputs[1:], k_append.outputs[0]],
           [score.outputs[0], k_append.outputs[0]], score.layer,
           [q_rope, k_norm, k_rope, k_append, score], io=io, n_heads=a["n_heads"],
           head_dim=a["head_dim"], eps=k_norm.attrs["eps"], rope=q_rope.attrs["rope"],
           rotary_dim=q_rope.attrs["rotary_dim"], softmax_scale=a["softmax_scale"],
           head_weight_scale=a["head_weight_scale"])
    f.emit(topk.name, "dsa_topk", list(topk.inputs), list(topk.outputs), topk.layer, [topk],
           topk=topk.attrs["topk"])
