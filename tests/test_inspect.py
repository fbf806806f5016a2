"""`tilertc inspect`: the op table, the bytes a token reads, and clean errors."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from tilertc import load_spec
from tilertc.cli import main
from tilertc.ir.target import TARGETS
from tilertc.model_specs.load import CONFIGS_DIR
from tilertc.model_specs.spec import ModelSpec

BF16 = 2


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["inspect", *args])
    assert "Traceback" not in result.output
    if result.exit_code == 0:
        assert result.exception is None
    return result.exit_code, result.output


def inspect_json(*args: str) -> dict:
    code, out = run(*args, "--json")
    assert code == 0, out
    return json.loads(out)


def gqa_weight_bytes(spec: ModelSpec) -> int:
    """Weight bytes one token reads, counted from the published dimensions (dense or Qwen3-MoE
    layers), independently of the graph: every projection once, k of the routed experts, one
    embedding row unless the table is tied to lm_head (then lm_head reads all of it)."""
    h, q, kv = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    attn = h * q * 2 + h * kv * 2 + 2 * h + (2 * spec.head_dim if spec.qk_norm else 0)
    params = 0
    for layer in range(spec.num_layers):
        if spec.is_moe_layer(layer):
            m = spec.moe
            ffn = m.num_experts * h + 3 * h * m.moe_intermediate_size * m.experts_per_token
        else:
            ffn = 3 * h * spec.intermediate_size
        params += attn + ffn
    params += spec.vocab_size * h + h + (0 if spec.tie_word_embeddings else h)
    return params * BF16


def test_help():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0 and "inspect" in result.output
    code, out = run("--help")
    assert code == 0
    for option in ("MODEL", "--target", "--max-seq-len", "--json", "--summary", "--set"):
        assert option in out


def test_table_for_llama_3_2_1b_reports_2_47_gb():
    expected = gqa_weight_bytes(load_spec("llama-3.2-1b"))
    assert round(expected / 1e9, 2) == 2.47  # the published size of the model's matrices
    code, out = run("llama-3.2-1b")
    assert code == 0
    for text in ("layers.15.ffn.down_proj", "lm_head", "rms_norm", "128256 fp32", "33.6 MB",
                 f"weights read per token:   2.47 GB ({expected} bytes", "at context 4096",
                 "bandwidth floor on h200"):
        assert text in out, text


@pytest.mark.parametrize("name", ["llama-tiny", "llama-tiny-odd", "qwen3-tiny",
                                  "qwen3-moe-tiny", "qwen3-8b", "qwen3-30b-a3b"])
def test_weight_bytes_match_an_independent_count(name):
    d = inspect_json(name)
    assert d["totals"]["weight_bytes_per_token"] == gqa_weight_bytes(load_spec(name))
    assert sum(op["weight_bytes_per_token"] for op in d["ops"]) == gqa_weight_bytes(
        load_spec(name))


@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "deepseek-v3-tiny", "deepseek-v3.2-tiny",
                                  "glm-5-tiny"])
def test_moe_counts_only_the_experts_a_token_reads(name):
    spec = load_spec(name)
    t = inspect_json(name)["totals"]
    m, h = spec.moe, spec.hidden_size
    moe_layers = sum(spec.is_moe_layer(i) for i in range(spec.num_layers))
    unread_experts = moe_layers * (m.num_experts - m.experts_per_token) * 3 * h * \
        m.moe_intermediate_size * BF16
    unread_embedding_rows = 0 if spec.tie_word_embeddings else (spec.vocab_size - 1) * h * BF16
    assert t["weight_bytes_stored"] - t["weight_bytes_per_token"] == (
        unread_experts + unread_embedding_rows)
    assert (t["moe_routed_experts_read_per_token"], t["moe_routed_experts"]) == (
        m.experts_per_token, m.num_experts)


def test_json_is_stable_and_consistent():
    first, second = run("qwen3-tiny", "--json"), run("qwen3-tiny", "--json")
    assert first == second
    d = json.loads(first[1])
    assert set(d) == {"spec", "target", "context", "ops", "totals"}
    assert d["spec"]["hidden_size"] == 64 and d["spec"]["qk_norm"] is True
    t = d["totals"]
    assert t["kv_bytes_per_token"] == sum(op["kv_bytes_per_token"] for op in d["ops"])
    assert t["bytes_per_token"] == t["weight_bytes_per_token"] + t["kv_bytes_per_token"]
    assert t["floor_s_per_token"] == pytest.approx(t["bytes_per_token"] / 4.40e12)
    assert t["max_tokens_per_s"] == pytest.approx(1 / t["floor_s_per_token"])
    assert [op["name"] for op in d["ops"]][:2] == ["embed", "layers.0.input_norm"]


def test_summary_folds_identical_layers_and_keeps_totals():
    full, folded = inspect_json("llama-3.2-1b"), inspect_json("llama-3.2-1b", "--summary")
    assert folded["totals"] == full["totals"]
    assert len(folded["ops"]) * 10 < len(full["ops"])
    q = next(op for op in folded["ops"] if op["name"] == "layers.0-15.q_proj")
    assert (q["count"], q["layers"], q["weight_bytes_per_token"]) == (16, [0, 15], 2048**2 * 2)
    assert sum(op["weight_bytes_per_token"] * op["count"] for op in folded["ops"]) == \
        full["totals"]["weight_bytes_per_token"]
    code, out = run("llama-3.2-1b", "--summary")
    assert code == 0 and "layers.0-15.ffn.up_proj" in out and "layers.3." not in out


def test_summary_separates_dense_and_moe_layers():
    ops = inspect_json("deepseek-v3-tiny", "--summary")["ops"]
    runs = sorted({tuple(op["layers"]) for op in ops if op["layers"]})
    assert runs == [(0, 0), (1, 2)]  # first_k_dense_replace = 1


def test_kv_bytes_scale_with_context():
    spec = load_spec("llama-tiny")
    row = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * BF16  # K and V, all layers
    for ctx in (100, 200):
        t = inspect_json("llama-tiny", "--max-seq-len", str(ctx))["totals"]
        assert t["kv_bytes_per_token"] == t["kv_cache_bytes"] == ctx * row
    code, out = run("llama-tiny", "--max-seq-len", "4096")
    assert code == 2 and "max_position_embeddings 2048" in out


@pytest.mark.parametrize("name", ["deepseek-v3.2-tiny", "glm-5-tiny"])
def test_dsa_attention_reads_only_the_top_k_rows(name):
    spec = load_spec(name)
    latent_row = (spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim) * BF16
    index_row = spec.indexer.head_dim * BF16
    for ctx in (64, 128):  # both above index_topk = 8
        ops = {op["name"]: op for op in inspect_json(name, "--max-seq-len", str(ctx))["ops"]}
        assert ops["layers.1.attention"]["kv_bytes_per_token"] == spec.indexer.topk * latent_row
        assert ops["layers.1.dsa.score"]["kv_bytes_per_token"] == ctx * index_row
    ops = {op["name"]: op for op in inspect_json(name, "--max-seq-len", "5")["ops"]}
    assert ops["layers.1.attention"]["kv_bytes_per_token"] == 5 * latent_row  # dense below top-k


def test_target_sets_the_bandwidth():
    t = inspect_json("llama-tiny", "--target", "h100")["totals"]
    h100 = TARGETS["h100"].hbm_bandwidth
    assert t["floor_s_per_token"] == pytest.approx(t["bytes_per_token"] / h100)
    code, out = run("llama-tiny", "--target", "a100")
    assert code == 2 and "h200" in out


def test_config_path_and_directory(tmp_path):
    model_dir = tmp_path / "TinyLlama"
    model_dir.mkdir()
    shutil.copy(CONFIGS_DIR / "llama-tiny.json", model_dir / "config.json")
    for arg in (model_dir, model_dir / "config.json"):
        d = inspect_json(str(arg))
        assert d["spec"]["name"] == "TinyLlama" and d["spec"]["num_layers"] == 2


def test_overrides_with_set():
    d = inspect_json("llama-tiny", "--set", "num_hidden_layers=1",
                     "--set", "tie_word_embeddings=false")
    assert d["spec"]["num_layers"] == 1 and d["spec"]["tie_word_embeddings"] is False
    code, out = run("llama-tiny", "--set", "num_hidden_layers")
    assert code == 2 and "KEY=VALUE" in out


def test_unknown_model_suggests_and_fails_without_traceback():
    code, out = run("llama-3.2-1bb")
    assert code == 1
    assert out.startswith("Error: ") and "did you mean llama-3.2-1b" in out


def test_bad_config_names_the_field(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads((CONFIGS_DIR / "llama-tiny.json").read_text()),
                                "num_key_value_heads": 3}))
    code, out = run(str(path))
    assert code == 1 and str(path) in out and "'num_key_value_heads'" in out
