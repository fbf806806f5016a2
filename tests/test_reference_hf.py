"""The reference interpreter against Hugging Face transformers, one tiny model per family.

Each case builds transformers' own model of a built-in tiny config with random float32 weights,
saves it as a checkpoint (so the interpreter reads real checkpoint keys, per-expert MoE weights
included), and compares our prefill + step-by-step decode with transformers' logits of the whole
sequence in one forward pass. The DSA cases run past `index_topk` so the sparse selection is
live, and their selections are compared with transformers' indexer token by token.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from tilertc.ir import interpreter  # noqa: E402
from tilertc.ir.build import build_graph  # noqa: E402
from tilertc.ir.moe import route  # noqa: E402
from tilertc.ir.reference import Reference  # noqa: E402
from tilertc.model_specs import load_spec  # noqa: E402

PREFILL, DECODE = 24, 8
TOLERANCE = 1e-4  # relative error per position; float32 on both sides lands near 1e-6

# Built-in tiny config and the overrides a case needs. DSA cases use 16 index heads: with 4, a
# token whose every head has a negative dot product scores exactly 0, such ties are frequent,
# and transformers breaks them in torch.topk's unspecified order.
CASES = {
    "llama": ("llama-tiny", {}),
    "qwen3": ("qwen3-tiny", {}),
    "qwen3_moe": ("qwen3-moe-tiny", {"num_hidden_layers": 3, "mlp_only_layers": [1]}),
    "deepseek_v3": ("deepseek-v3-tiny", {}),
    # No q LoRA (plain q_proj), rotate-half RoPE and projection biases.
    "deepseek_v3_plain_q": ("deepseek-v3-tiny", {"q_lora_rank": None, "rope_interleave": False,
                                                 "attention_bias": True}),
    "deepseek_v32": ("deepseek-v3.2-tiny", {"index_n_heads": 16}),
    # Layer 2 reuses layer 1's selection.
    "glm_moe_dsa": ("glm-5-tiny", {"index_n_heads": 16,
                                   "indexer_types": ["full", "full", "shared"]}),
}


def hf_model(cfg: dict, seed: int = 0) -> torch.nn.Module:
    """transformers' model of `cfg` with every parameter (and router bias) redrawn.

    Norm weights around 1, everything else N(0, 0.08), so that activations stay in range and
    the router's correction bias is large enough to change which experts are chosen.
    """
    config = transformers.AutoConfig.for_model(**cfg)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model = model.float().eval()
    gen = torch.Generator().manual_seed(seed)
    tensors = dict(model.named_parameters())
    tensors.update((n, b) for n, b in model.named_buffers() if n.endswith("correction_bias"))
    with torch.no_grad():
        for name, p in sorted(tensors.items()):
            noise = torch.randn(p.shape, generator=gen)
            is_norm_weight = "norm" in name and name.endswith("weight")
            p.copy_(1 + 0.1 * noise if is_norm_weight else 0.08 * noise)
    return model


def relative_error(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """‖got − want‖ / ‖want‖ along the last dimension."""
    return (got - want).norm(dim=-1) / want.norm(dim=-1)


def record_topk(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, torch.Tensor]]:
    """(op name, ids) of every `dsa_topk` the interpreter runs from now on."""
    calls: list[tuple[str, torch.Tensor]] = []
    inner = interpreter.SEMANTICS["dsa_topk"]

    def recording(op, ins, step):
        outs = inner(op, ins, step)
        calls.append((op.name, outs[0].clone()))
        return outs

    monkeypatch.setitem(interpreter.SEMANTICS, "dsa_topk", recording)
    return calls


def record_hf_indexers(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """Layer -> transformers' indexer output [S, topk] of the next forward pass."""
    out: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):
        if getattr(layer.self_attn, "indexer", None) is not None:
            layer.self_attn.indexer.register_forward_hook(
                lambda mod, args, res, i=i: out.__setitem__(i, res[0].long()))
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_prefill_and_decode_match_transformers(case, tmp_path, monkeypatch):
    name, overrides = CASES[case]
    spec = load_spec(name, overrides)
    model = hf_model(spec.hf_config)
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, spec.vocab_size, (PREFILL + DECODE,),
                        generator=torch.Generator().manual_seed(1))
    hf_topk = record_hf_indexers(model)
    with torch.no_grad():
        want = model(ids[None]).logits[0]

    ref = Reference(spec, tmp_path, max_seq_len=64)
    topk_calls = record_topk(monkeypatch)
    got = torch.cat([ref.prefill(ids[:PREFILL])]
                    + [ref.decode(t)[None] for t in ids[PREFILL:]])

    err = relative_error(got, want)
    assert err.max() <= TOLERANCE, f"{case}: worst position {err.argmax()} error {err.max():.2e}"
    if spec.indexer is not None:
        check_selection(spec, topk_calls, hf_topk)


def check_selection(spec, calls: list[tuple[str, torch.Tensor]],
                    hf_topk: dict[int, torch.Tensor]) -> None:
    """Our top-k per token equals transformers' once the context exceeds index_topk, and some
    tokens are really left out."""
    k = spec.indexer.topk
    ours: dict[int, torch.Tensor] = {}
    for op_name, ids in calls:
        layer = int(op_name.split(".")[1])
        ours[layer] = torch.cat([ours[layer], ids]) if layer in ours else ids
    assert sorted(ours) == sorted(hf_topk) == [i for i in range(spec.num_layers)
                                              if spec.indexer.runs_indexer(i)]
    for layer, ids in ours.items():
        for pos in range(k - 1, PREFILL + DECODE):
            assert set(ids[pos].tolist()) == set(hf_topk[layer][pos].tolist()), (layer, pos)
        last = ids[-1]
        assert (last >= 0).sum() == k < PREFILL + DECODE  # k of the context, the rest excluded


@pytest.mark.parametrize("case", ["qwen3_moe", "deepseek_v3", "glm_moe_dsa"])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_router_matches_transformers(case, norm_topk_prob):
    """Expert choice and weights on many tokens, against transformers' router module (group
    limits and the correction bias decide some of them)."""
    name, overrides = CASES[case]
    spec = load_spec(name, {**overrides, "norm_topk_prob": norm_topk_prob})
    model = hf_model(spec.hf_config)
    layer = next(i for i in range(spec.num_layers) if spec.is_moe_layer(i))
    gate = model.model.layers[layer].mlp.gate
    attrs = build_graph(spec, 8).op(f"layers.{layer}.moe.router").attrs
    x = torch.randn(512, spec.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, hf_weights, hf_ids = gate(x)
    bias = getattr(gate, "e_score_correction_bias", None)
    ids, weights = route(F.linear(x, gate.weight), bias, attrs)
    hf_order, order = hf_ids.argsort(-1), ids.argsort(-1)
    assert torch.equal(hf_ids.gather(1, hf_order), ids.gather(1, order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.float().gather(1, hf_order),
                               rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("overrides", [
    {"model_type": "qwen3_moe", "num_hidden_layers": 6, "decoder_sparse_step": 2,
     "mlp_only_layers": [3]},
    {"model_type": "deepseek_v32", "mlp_layer_types": ["dense", "sparse", "dense", "sparse"]},
    {"model_type": "glm_moe_dsa", "num_hidden_layers": 7, "index_topk_freq": 3,
     "index_skip_topk_offset": 1},
    {"model_type": "glm_moe_dsa", "index_topk_pattern": "FSFS"},
])
def test_layer_plans_match_transformers(overrides):
    """Which layers are MoE and which run an indexer, as transformers builds the model."""
    base = {"qwen3_moe": "qwen3-moe-tiny", "deepseek_v32": "deepseek-v3.2-tiny",
            "glm_moe_dsa": "glm-5-tiny"}[overrides["model_type"]]
    n = overrides.get("num_hidden_layers", 4)
    spec = load_spec(base, {"num_hidden_layers": n, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**spec.hf_config))
    layers = model.model.layers
    assert [spec.is_moe_layer(i) for i in range(n)] == [hasattr(m.mlp, "experts") for m in layers]
    if spec.indexer is not None:
        assert ([spec.indexer.runs_indexer(i) for i in range(n)]
                == [m.self_attn.indexer is not None for m in layers])


@pytest.mark.parametrize("case", sorted(CASES))
def test_graph_is_deterministic(case):
    name, overrides = CASES[case]
    spec = load_spec(name, overrides)
    assert build_graph(spec, 32).to_json() == build_graph(spec, 32).to_json()


def test_fresh_interpreter_shares_the_weights_and_starts_from_an_empty_cache():
    """`Interpreter.fresh` (what the engine's reference is): the same weight tensors, not a
    copy; a zeroed cache of its own, in the dtype asked for; and the same logits as an
    interpreter built from the checkpoint for the same tokens."""
    from tilertc.ir.weights import random_weights

    spec = load_spec("llama-tiny")
    graph = build_graph(spec, 32)
    weights = random_weights(graph, seed=3)
    first = interpreter.Interpreter(graph, weights)
    tokens = torch.randint(0, spec.vocab_size, (5,), generator=torch.Generator().manual_seed(4))
    first.run(tokens, torch.arange(5))
    other = first.fresh(torch.bfloat16)
    assert other.params is first.params
    assert all(other.state[n].dtype == torch.bfloat16 and not other.state[n].any()
               and first.state[n].any() for n in first.state)
    again = first.fresh()
    want = interpreter.Interpreter(graph, weights).run(tokens, torch.arange(5))["logits"]
    assert torch.equal(again.run(tokens, torch.arange(5))["logits"], want)


def test_moe_experts_get_their_weights_as_stored(monkeypatch):
    """The interpreter hands `moe_experts` its expert weights in their own dtype (the op widens
    the chosen ones itself: a full-size layer's experts widened at once would not fit beside the
    kernel's), and the logits are those of every weight widened before the op."""
    from tilertc.ir.weights import random_weights

    spec = load_spec("qwen3-moe-tiny")
    graph = build_graph(spec, 32)
    weights = random_weights(graph, seed=5)
    tokens = torch.randint(0, spec.vocab_size, (6,), generator=torch.Generator().manual_seed(6))
    seen: list[torch.dtype] = []
    experts = interpreter.SEMANTICS["moe_experts"]

    def spy(op, ins, step):
        seen.extend(t.dtype for t in ins[3:])
        return experts(op, ins, step)

    monkeypatch.setitem(interpreter.SEMANTICS, "moe_experts", spy)
    got = interpreter.Interpreter(graph, weights).run(tokens, torch.arange(6))["logits"]
    assert seen and set(seen) == {torch.bfloat16}
    monkeypatch.setattr(interpreter, "OWN_WIDENING", set())  # widen before the op, as others
    seen.clear()
    want = interpreter.Interpreter(graph, weights).run(tokens, torch.arange(6))["logits"]
    assert set(seen) == {torch.float32}
    assert torch.equal(got, want)
