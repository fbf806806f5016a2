"""DeepSeek Sparse Attention: the lightning indexer that picks which tokens MLA attends to.

Per layer, the indexer projects a few small heads: queries from the q-LoRA output
(q = wq_b(q_resid), `n_heads` × `head_dim`), one key per token from the hidden state
(k = LayerNorm(wk(x)), cached like a KV row), and per-head weights w = weights_proj(x). Both
RoPE-rotate their first qk_rope_head_dim dims (halves for DeepSeek-V3.2, interleaved pairs for
GLM-5). A query's score for a cached token t is

    score[t] = Σ_h w[h] · n_heads^-0.5 · relu(q[h] · k[t] · head_dim^-0.5),

and the attention keeps the top min(index_topk, context) tokens; at contexts up to index_topk it
is dense. This is the exact form transformers computes; the reference release's Hadamard
rotation (orthogonal, so scores are unchanged) and FP8 rounding are not simulated.

GLM-5 may let a layer reuse the selection of the closest earlier layer that ran an indexer.
"""

from __future__ import annotations

import torch

from tilertc.ir.blocks import act, projection, rotate, weight
from tilertc.ir.build import rope_attrs
from tilertc.ir.graph import Graph, Op, TensorKind
from tilertc.ir.interpreter import Step, causal_mask, semantics
from tilertc.model_specs.spec import ModelSpec

# transformers and the reference code build the indexer's key LayerNorm with eps 1e-6.
INDEX_K_NORM_EPS = 1e-6


def dsa_selection(g: Graph, spec: ModelSpec, layer: int, xn: str, q_resid: str,
                  seq: int) -> str:
    """The top-k token ids [index_topk] (-1 past the context) that layer `layer` attends to."""
    ix, i = spec.indexer, layer
    if not ix.runs_indexer(i):
        return f"layers.{max(j for j in range(i) if ix.runs_indexer(j))}.dsa.topk"
    heads, d, rope_dim = ix.n_heads, ix.head_dim, spec.mla.qk_rope_head_dim
    rope = rope_attrs(spec, interleaved=ix.rope_interleaved)
    q = projection(g, i, "self_attn.indexer.wq_b", q_resid, "dsa.q", heads * d)
    q = rotate(g, i, q, "dsa.q_rope", heads, d, rope, rotary_dim=rope_dim)
    k = projection(g, i, "self_attn.indexer.wk", xn, "dsa.k", d)
    k_normed = act(g, i, "dsa.k_normed", (d,))
    g.add(f"layers.{i}.dsa.k_norm", "layer_norm",
          [k, weight(g, i, "self_attn.indexer.k_norm", (d,)),
           weight(g, i, "self_attn.indexer.k_norm.bias", (d,), param=None)],
          [k_normed], layer=i, eps=INDEX_K_NORM_EPS)
    k = rotate(g, i, k_normed, "dsa.k_rope", 1, d, rope, rotary_dim=rope_dim)
    cache = g.tensor(f"layers.{i}.dsa.k_cache", (seq, d), "bf16", TensorKind.KV_CACHE)
    g.add(f"layers.{i}.dsa.k_append", "kv_append", [k, "pos"], [cache], layer=i)
    # weights_proj stays bf16 in the FP8 checkpoints (DeepSeek-V3.2's reference model.py).
    head_weights = projection(g, i, "self_attn.indexer.weights_proj", xn, "dsa.head_weights",
                              heads, quantized=False)
    scores = act(g, i, "dsa.scores", (seq,))
    g.add(f"layers.{i}.dsa.score", "dsa_index_score", [q, head_weights, cache, "pos"], [scores],
          layer=i, n_heads=heads, head_dim=d, softmax_scale=d ** -0.5,
          head_weight_scale=heads ** -0.5)
    top = act(g, i, "dsa.topk", (ix.topk,), "int64")
    g.add(f"layers.{i}.dsa.topk", "dsa_topk", [scores], [top], layer=i, topk=ix.topk)
    return top


def selection_mask(ids: torch.Tensor, n: int) -> torch.Tensor:
    """[T, n] True at the token ids [T, k] a query selected (-1 entries select nothing)."""
    mask = torch.zeros(ids.shape[0], n + 1, dtype=torch.bool, device=ids.device)
    mask.scatter_(1, torch.where(ids >= 0, ids, n), True)  # -1 lands in the spare column n
    return mask[:, :n]


@semantics("dsa_index_score")
def _dsa_index_score(op: Op, ins: list[torch.Tensor], step: Step) -> list[torch.Tensor]:
    """Scores [T, seq] of every cache slot; -inf where the query may not look."""
    q, w, cache = ins[0], ins[1], ins[2]
    a = op.attrs
    t = q.shape[0]
    n = int(step.positions.max()) + 1
    keys = cache[:n].to(step.dtype)
    dots = torch.einsum("thd,nd->thn", q.reshape(t, a["n_heads"], a["head_dim"]), keys)
    relu = (dots * a["softmax_scale"]).relu()
    scores = torch.einsum("th,thn->tn", w * a["head_weight_scale"], relu)
    out = torch.full((t, cache.shape[0]), float("-inf"), dtype=scores.dtype, device=q.device)
    out[:, :n] = scores.masked_fill(~causal_mask(step, n), float("-inf"))
    return [out]


@semantics("dsa_topk")
def _dsa_topk(op: Op, ins: list[torch.Tensor], step: Step) -> list[torch.Tensor]:
    """Ids [T, topk] of the best-scored visible tokens, in increasing token order, then -1
    where fewer exist.

    Which tokens: the `topk` largest scores, equal scores (all heads' ReLUs zero gives exact 0)
    going to the earlier token, so that the selection is a function of the scores alone
    (transformers leaves ties to torch.topk). Why increasing order and not best first: the
    attention over the selection does not depend on its order, and the kernel finds the
    selection by counting, without sorting it (decode/dsa.cuh: run_dsa_topk, a radix
    selection), and lists it as it walks the tokens.
    """
    scores, k = ins[0], op.attrs["topk"]
    best = scores.sort(dim=-1, descending=True, stable=True)
    ids = best.indices[:, :k].masked_fill(best.values[:, :k] == float("-inf"), scores.shape[-1])
    ids = ids.sort(dim=-1).values  # the -1 stand-ins (one past every token) sort last
    ids = ids.masked_fill(ids == scores.shape[-1], -1)
    return [torch.nn.functional.pad(ids, (0, k - ids.shape[-1]), value=-1)]
