"""FP8 e4m3 block-scaled weights: frontend, IR tensors, quantization, interpreter, inspect.

The interpreter's FP8 path is checked against an independent one: the same model as a plain
(bf16-format) spec whose float32 weights were dequantized up front, here, in float64.
"""

from __future__ import annotations

import pytest
import torch

from tilertc.inspect import inspect_model
from tilertc.ir.build import build_graph
from tilertc.ir.fp8 import FP8_E4M3_MAX, dequantize, quantize
from tilertc.ir.reference import Reference
from tilertc.ir.target import get_target
from tilertc.ir.weights import random_weights
from tilertc.model_specs import SpecError, load_spec

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
       "activation_scheme": "dynamic"}
UE8M0 = {**FP8, "scale_fmt": "ue8m0"}
BLOCK = (128, 128)


@pytest.mark.parametrize("ue8m0", [False, True])
def test_quantize_dequantize_round_trip_is_within_e4m3_precision(ue8m0):
    """Partial edge blocks included (300 x 200 is 3 x 2 blocks, the last ones partial)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=gen, dtype=torch.float64)
    w[:128, :128] *= 1e-3  # blocks of very different ranges get their own scales
    w[128:256, 128:] = 0.0  # an all-zero block
    q, s = quantize(w, BLOCK, ue8m0)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (3, 2)
    blocks = [(slice(r, r + 128), slice(c, c + 128)) for r in (0, 128, 256) for c in (0, 128)]
    amax = torch.tensor([w[b].abs().max().item() for b in blocks]).reshape(3, 2)
    if ue8m0:
        assert torch.equal(s, torch.exp2(torch.log2(s).round())), "scales are powers of two"
    else:
        expected = torch.where(amax > 0, amax / FP8_E4M3_MAX, 1.0).float()
        torch.testing.assert_close(s, expected, rtol=0, atol=0)
        assert all(q[b].float().abs().max() in (0.0, FP8_E4M3_MAX) for b in blocks)
    scale = torch.kron(s.double(), torch.ones(128, 128))[:300, :200]
    err = (dequantize(q, s, BLOCK).double() - w).abs()
    # 3 mantissa bits: half an ulp is 2^-4 of a normal value; subnormals step by 2^-9 · scale.
    assert (err <= torch.maximum(w.abs() * 2.0 ** -4, scale * 2.0 ** -10)).all()
    assert err[128:256, 128:].max() == 0


def dequantized_plain_weights(graph, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The FP8 checkpoint as a bf16-format one: each weight times its block scales (float64
    Kronecker product, independent of `ir/fp8.py`), scale tensors dropped."""
    out = {}
    for t in graph.weights():
        if t.name.endswith(".weight_scale_inv"):
            continue
        w = weights[t.hf_name]
        if "scale_inv" in t.attrs:
            s = weights[graph.tensors[t.attrs["scale_inv"]].hf_name].double()
            w = (w.double() * torch.kron(s, torch.ones(*BLOCK))[:w.shape[0], :w.shape[1]])
        out[t.hf_name] = w.float()
    return out


@pytest.mark.parametrize(("name", "quant"), [("deepseek-v3-tiny", UE8M0),
                                             ("deepseek-v3.2-tiny", UE8M0), ("llama-tiny", FP8)])
def test_fp8_model_matches_its_dequantized_bf16_twin(name, quant):
    fp8_spec = load_spec(name, {"quantization_config": quant})
    plain_spec = load_spec(name)
    graph = build_graph(fp8_spec, 32)
    weights = random_weights(graph, seed=3, std=0.08)
    assert {w.dtype for w in weights.values()} >= {torch.float8_e4m3fn, torch.float32}
    fp8 = Reference(fp8_spec, weights, max_seq_len=32)
    plain = Reference(plain_spec, dequantized_plain_weights(graph, weights), max_seq_len=32)
    ids = torch.randint(0, fp8_spec.vocab_size, (12,), generator=torch.Generator().manual_seed(4))
    got = torch.cat([fp8.prefill(ids[:8])] + [fp8.decode(t)[None] for t in ids[8:]])
    want = torch.cat([plain.prefill(ids[:8])] + [plain.decode(t)[None] for t in ids[8:]])
    assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max() < 1e-5


def test_fp8_graph_quantizes_the_projections_the_checkpoints_quantize():
    """DeepSeek-V3.2's FP8 checkpoint keeps embeddings, norms, lm_head, the router gate and the
    indexer's weights_proj in bf16 (and the router bias in fp32); every other matrix is FP8."""
    spec = load_spec("deepseek-v3.2", {"num_hidden_layers": 4})
    g = build_graph(spec, 64)
    dtypes = {t.hf_name: t.dtype for t in g.weights()}
    for bf16 in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 "model.layers.3.mlp.gate.weight", "model.layers.3.input_layernorm.weight",
                 "model.layers.3.self_attn.indexer.weights_proj.weight"):
        assert dtypes[bf16] == "bf16", bf16
    for fp8 in ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa",
                "self_attn.kv_b_proj", "self_attn.o_proj", "self_attn.indexer.wq_b",
                "self_attn.indexer.wk", "mlp.experts.255.down_proj", "mlp.shared_experts.up_proj"):
        assert dtypes[f"model.layers.3.{fp8}.weight"] == "fp8_e4m3", fp8
        assert dtypes[f"model.layers.3.{fp8}.weight_scale_inv"] == "fp32", fp8
    assert dtypes["model.layers.0.mlp.gate_proj.weight"] == "fp8_e4m3"
    scale = g.tensors["layers.3.self_attn.kv_b_proj.weight_scale_inv"]
    assert scale.shape == (128 * 256 // 128, 512 // 128)
    assert "layers.3.self_attn.o_proj.weight_scale_inv" in g.op("layers.3.o_proj").inputs


def test_builtin_weight_formats():
    """DeepSeek-V3.2 ships FP8 (ue8m0 scales); MODELS.md states no format for GLM-5: bf16."""
    ds = load_spec("deepseek-v3.2").weight_format
    assert (ds.dtype, ds.block, ds.scale_fmt) == ("fp8_e4m3", BLOCK, "ue8m0")
    assert load_spec("glm-5").weight_format.dtype == "bf16"
    assert load_spec("deepseek-v3.2", {"quantization_config": None}).weight_format.dtype == "bf16"


def test_inspect_counts_one_byte_per_fp8_weight_plus_scales():
    spec = load_spec("llama-tiny", {"quantization_config": FP8})
    g = build_graph(spec, 64)
    expected = sum(t.numel * {"bf16": 2, "fp8_e4m3": 1, "fp32": 4}[t.dtype] for t in g.weights())
    totals = inspect_model(spec, get_target("h200"), 64).totals
    assert totals["weight_bytes_stored"] == expected
    plain = inspect_model(load_spec("llama-tiny"), get_target("h200"), 64).totals
    assert totals["weight_bytes_stored"] < plain["weight_bytes_stored"]


def test_deepseek_v32_fp8_reads_about_half_the_bytes_of_bf16():
    target = get_target("h200")
    fp8 = inspect_model(load_spec("deepseek-v3.2"), target, 4096, summary=True).totals
    bf16 = inspect_model(load_spec("deepseek-v3.2", {"quantization_config": None}), target,
                         4096, summary=True).totals
    ratio = fp8["weight_bytes_per_token"] / bf16["weight_bytes_per_token"]
    print(f"deepseek-v3.2 weight bytes/token: fp8 {fp8['weight_bytes_per_token'] / 1e9:.2f} GB, "
          f"bf16 {bf16['weight_bytes_per_token'] / 1e9:.2f} GB, ratio {ratio:.3f}")
    assert 0.5 < ratio < 0.56


@pytest.mark.parametrize(("quant", "field", "says"), [
    ({**FP8, "quant_method": "awq"}, "quantization_config.quant_method", "'awq'"),
    ({**FP8, "fmt": "e5m2"}, "quantization_config.fmt", "'e5m2'"),
    ({**FP8, "weight_block_size": [64, 128]}, "quantization_config.weight_block_size",
     "only 128x128 blocks"),
    ({**FP8, "scale_fmt": "e8m0"}, "quantization_config.scale_fmt", "'e8m0'"),
    ({**FP8, "activation_scheme": "static"}, "quantization_config.activation_scheme", "'static'"),
    ({**FP8, "modules_to_not_convert": ["model.layers.0.mlp"]},
     "quantization_config.modules_to_not_convert", "model.layers.0.mlp"),
    ("fp8", "quantization_config", "expected a JSON object"),
])
def test_unsupported_quantization_configs_are_named(quant, field, says):
    with pytest.raises(SpecError, match=f"field '{field}'.*{says}"):
        load_spec("llama-tiny", {"quantization_config": quant})


def test_interpreter_keeps_fp8_weights_as_stored_and_dequantizes_them_per_op() -> None:
    """The interpreter holds an FP8 weight as its e4m3 values and block scales (1 byte a value
    on the device) and dequantizes it when an op reads it: `weight()` is the dequantized
    checkpoint, exactly."""
    from tilertc.ir.interpreter import BlockScaled, Interpreter
    from tilertc.model_specs.hf import with_weight_dtype

    graph = build_graph(with_weight_dtype(load_spec("llama-tiny"), "fp8"), 32)
    weights = random_weights(graph, seed=5)
    interp = Interpreter(graph, weights)
    fp8 = [t for t in graph.weights() if "scale_inv" in t.attrs]
    assert fp8
    for t in fp8:
        stored = interp.params[t.name]
        assert isinstance(stored, BlockScaled) and stored.weight.dtype == torch.float8_e4m3fn
        scale = weights[graph.tensors[t.attrs["scale_inv"]].hf_name]
        want = dequantize(weights[t.hf_name], scale, tuple(t.attrs["block"]))
        assert torch.equal(interp.weight(t.name), want)
