"""The frontend: built-in specs carry the published dimensions, and bad configs fail clearly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tilertc import SpecError, load_spec
from tilertc.model_specs import builtin_names
from tilertc.model_specs.load import CONFIGS_DIR

# Published values (docs: /work/shared/MODELS.md, the models' config.json files). Dotted keys
# reach into the sub-specs.
LLAMA3_ROPE = {"rope.rope_type": "llama3", "rope.theta": 500000.0, "rope.low_freq_factor": 1.0,
               "rope.high_freq_factor": 4.0, "rope.original_max_position_embeddings": 8192}
QWEN3 = {"rope.theta": 1e6, "rope.rope_type": "default", "qk_norm": True, "rms_norm_eps": 1e-6,
         "max_position_embeddings": 40960, "vocab_size": 151936, "head_dim": 128}
PUBLISHED = {
    "llama-3.2-1b": {**LLAMA3_ROPE, "hidden_size": 2048, "num_layers": 16, "num_heads": 32,
                     "num_kv_heads": 8, "head_dim": 64, "intermediate_size": 8192,
                     "vocab_size": 128256, "rope.factor": 32.0, "tie_word_embeddings": True,
                     "qk_norm": False, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072},
    "llama-3.1-8b": {**LLAMA3_ROPE, "hidden_size": 4096, "num_layers": 32, "num_heads": 32,
                     "num_kv_heads": 8, "head_dim": 128, "intermediate_size": 14336,
                     "vocab_size": 128256, "rope.factor": 8.0, "tie_word_embeddings": False,
                     "qk_norm": False, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072},
    "qwen3-0.6b": {**QWEN3, "hidden_size": 1024, "num_layers": 28, "num_heads": 16,
                   "num_kv_heads": 8, "intermediate_size": 3072, "tie_word_embeddings": True},
    "qwen3-1.7b": {**QWEN3, "hidden_size": 2048, "num_layers": 28, "num_heads": 16,
                   "num_kv_heads": 8, "intermediate_size": 6144, "tie_word_embeddings": True},
    "qwen3-8b": {**QWEN3, "hidden_size": 4096, "num_layers": 36, "num_heads": 32,
                 "num_kv_heads": 8, "intermediate_size": 12288, "tie_word_embeddings": False},
    "qwen3-32b": {**QWEN3, "hidden_size": 5120, "num_layers": 64, "num_heads": 64,
                  "num_kv_heads": 8, "intermediate_size": 25600, "tie_word_embeddings": False},
    "qwen3-30b-a3b": {**QWEN3, "hidden_size": 2048, "num_layers": 48, "num_heads": 32,
                      "num_kv_heads": 4, "tie_word_embeddings": False, "moe.num_experts": 128,
                      "moe.experts_per_token": 8, "moe.moe_intermediate_size": 768,
                      "moe.num_shared_experts": 0, "moe.scoring": "softmax",
                      "moe.norm_topk_prob": True, "moe.first_dense_layers": 0,
                      "moe.sparse_step": 1, "moe.mlp_only_layers": ()},
    "deepseek-v3.2": {
        "hidden_size": 7168, "num_layers": 61, "num_heads": 128, "intermediate_size": 18432,
        "vocab_size": 129280, "rms_norm_eps": 1e-6, "max_position_embeddings": 163840,
        "tie_word_embeddings": False,
        "mla.q_lora_rank": 1536, "mla.kv_lora_rank": 512, "mla.qk_nope_head_dim": 128,
        "mla.qk_rope_head_dim": 64, "mla.v_head_dim": 128,
        "moe.num_experts": 256, "moe.num_shared_experts": 1, "moe.experts_per_token": 8,
        "moe.moe_intermediate_size": 2048, "moe.n_group": 8, "moe.topk_group": 4,
        "moe.scoring": "sigmoid", "moe.has_correction_bias": True, "moe.norm_topk_prob": True,
        "moe.routed_scaling_factor": 2.5, "moe.first_dense_layers": 3,
        "indexer.n_heads": 64, "indexer.head_dim": 128, "indexer.topk": 2048,
        "indexer.rope_interleaved": False,
        "rope.theta": 10000.0, "rope.rope_type": "yarn", "rope.factor": 40.0,
        "rope.original_max_position_embeddings": 4096, "rope.beta_fast": 32.0,
        "rope.beta_slow": 1.0, "rope.mscale": 1.0, "rope.mscale_all_dim": 1.0,
        "rope.interleaved": True},
    "glm-5": {
        "hidden_size": 6144, "num_layers": 78, "num_heads": 64, "intermediate_size": 12288,
        "vocab_size": 154880, "rms_norm_eps": 1e-5, "max_position_embeddings": 202752,
        "tie_word_embeddings": False,
        "mla.q_lora_rank": 2048, "mla.kv_lora_rank": 512, "mla.qk_nope_head_dim": 192,
        "mla.qk_rope_head_dim": 64, "mla.v_head_dim": 256,
        "moe.num_experts": 256, "moe.num_shared_experts": 1, "moe.experts_per_token": 8,
        "moe.moe_intermediate_size": 2048, "moe.n_group": 1, "moe.topk_group": 1,
        "moe.scoring": "sigmoid", "moe.has_correction_bias": True, "moe.norm_topk_prob": True,
        "moe.routed_scaling_factor": 2.5, "moe.first_dense_layers": 3,
        "indexer.n_heads": 32, "indexer.head_dim": 128, "indexer.topk": 2048,
        "indexer.rope_interleaved": True,
        "rope.theta": 1e6, "rope.rope_type": "default", "rope.interleaved": True},
}

TINY = ["llama-tiny", "llama-tiny-odd", "qwen3-tiny", "qwen3-moe-tiny", "deepseek-v3-tiny",
        "deepseek-v3.2-tiny", "glm-5-tiny"]


def field(obj: object, dotted: str) -> object:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def config(name: str) -> dict:
    return json.loads((CONFIGS_DIR / f"{name}.json").read_text())


def write_config(tmp_path: Path, cfg: dict, name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return path


# -- built-ins ---------------------------------------------------------------------------------

def test_builtin_list_is_complete():
    assert set(builtin_names()) == set(PUBLISHED) | set(TINY)


@pytest.mark.parametrize("name", sorted(set(PUBLISHED) | set(TINY)))
def test_builtin_loads_with_its_name_and_type(name):
    spec = load_spec(name)
    assert spec.name == name
    assert spec.model_type == config(name)["model_type"]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_builtin_has_published_dimensions(name):
    spec = load_spec(name)
    actual = {k: field(spec, k) for k in PUBLISHED[name]}
    assert actual == PUBLISHED[name]


@pytest.mark.parametrize("name", sorted(set(PUBLISHED) | set(TINY)))
def test_transformers_reads_the_same_values(name):
    """The config files use the key names transformers 5.17 reads for their model_type."""
    transformers = pytest.importorskip("transformers")
    cfg = config(name)
    hf = transformers.AutoConfig.for_model(**cfg)
    spec = load_spec(name)
    assert (hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads, hf.vocab_size) == (
        spec.hidden_size, spec.num_layers, spec.num_heads, spec.vocab_size)
    assert hf.intermediate_size == spec.intermediate_size
    assert hf.tie_word_embeddings == spec.tie_word_embeddings
    assert hf.rms_norm_eps == pytest.approx(spec.rms_norm_eps)
    assert hf.rope_parameters["rope_theta"] == spec.rope.theta
    assert hf.rope_parameters["rope_type"] == spec.rope.rope_type
    if spec.mla is None:
        assert hf.num_key_value_heads == spec.num_kv_heads
        assert getattr(hf, "head_dim", None) in (None, spec.head_dim)
    else:
        assert (hf.q_lora_rank, hf.kv_lora_rank, hf.qk_nope_head_dim, hf.qk_rope_head_dim,
                hf.v_head_dim) == (spec.mla.q_lora_rank, spec.mla.kv_lora_rank,
                                   spec.mla.qk_nope_head_dim, spec.mla.qk_rope_head_dim,
                                   spec.mla.v_head_dim)
    if spec.moe is not None:
        assert hf.num_local_experts == spec.moe.num_experts
        assert hf.num_experts_per_tok == spec.moe.experts_per_token
        assert hf.moe_intermediate_size == spec.moe.moe_intermediate_size
        assert getattr(hf, "n_group", 1) == spec.moe.n_group
        assert getattr(hf, "topk_group", 1) == spec.moe.topk_group
        assert getattr(hf, "n_shared_experts", 0) == spec.moe.num_shared_experts
    if spec.indexer is not None:
        assert (hf.index_n_heads, hf.index_head_dim, hf.index_topk) == (
            spec.indexer.n_heads, spec.indexer.head_dim, spec.indexer.topk)


@pytest.mark.parametrize("name", TINY)
def test_tiny_specs_are_small(name):
    spec = load_spec(name)
    assert spec.num_layers <= 3 and spec.vocab_size <= 1000
    assert spec.hidden_size <= (576 if name == "llama-tiny-odd" else 128)


def test_tiny_specs_cover_the_code_paths():
    llama, odd, qwen = load_spec("llama-tiny"), load_spec("llama-tiny-odd"), load_spec("qwen3-tiny")
    assert llama.tie_word_embeddings and llama.rope.rope_type == "llama3"
    assert llama.num_kv_heads < llama.num_heads
    assert (odd.hidden_size, odd.num_heads, odd.num_kv_heads, odd.head_dim,
            odd.intermediate_size, odd.vocab_size) == (576, 9, 3, 64, 1536, 1000)
    assert qwen.qk_norm and qwen.num_heads * qwen.head_dim != qwen.hidden_size
    qmoe = load_spec("qwen3-moe-tiny")
    assert qmoe.moe.experts_per_token < qmoe.moe.num_experts and qmoe.qk_norm
    ds3 = load_spec("deepseek-v3-tiny")
    assert (ds3.moe.n_group, ds3.moe.topk_group, ds3.moe.num_shared_experts) == (4, 2, 1)
    assert ds3.rope.rope_type == "yarn" and ds3.rope.interleaved
    assert ds3.mla.q_lora_rank and ds3.indexer is None
    assert 0 < ds3.moe.first_dense_layers < ds3.num_layers
    ds32, glm = load_spec("deepseek-v3.2-tiny"), load_spec("glm-5-tiny")
    for dsa in (ds32, glm):
        assert dsa.indexer.topk == 8 < dsa.max_position_embeddings
        assert dsa.mla.q_lora_rank and dsa.moe.num_shared_experts == 1
    assert ds32.rope.rope_type == "yarn" and not ds32.indexer.rope_interleaved
    assert glm.moe.n_group == 1 and glm.indexer.rope_interleaved


# -- files, directories, overrides ---------------------------------------------------------------

def test_config_file_and_directory(tmp_path):
    model_dir = tmp_path / "My-Model"
    model_dir.mkdir()
    path = write_config(model_dir, config("llama-tiny"))
    by_file, by_dir = load_spec(path), load_spec(model_dir)
    assert by_file == by_dir and by_file.name == "My-Model"
    assert by_file.content_hash() == load_spec("llama-tiny").content_hash()
    other = write_config(tmp_path, config("qwen3-tiny"), "qwen-variant.json")
    assert load_spec(str(other)).name == "qwen-variant"


def test_overrides_apply_before_validation():
    spec = load_spec("llama-tiny", {"num_hidden_layers": 1, "vocab_size": 300})
    assert (spec.num_layers, spec.vocab_size) == (1, 300)
    assert load_spec("llama-tiny").num_layers == 2  # the built-in is not changed
    with pytest.raises(SpecError, match=r"with overrides of num_key_value_heads.*"
                                        r"'num_key_value_heads'"):
        load_spec("llama-tiny", {"num_key_value_heads": 3})


# -- errors ------------------------------------------------------------------------------------

def test_invalid_json_names_file_line_and_column(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama",\n  "hidden_size": ,\n}')
    with pytest.raises(SpecError) as e:
        load_spec(path)
    assert str(path) in str(e.value) and "line 2, column 18" in str(e.value)


def test_json_that_is_not_an_object(tmp_path):
    with pytest.raises(SpecError, match="expected a JSON object"):
        load_spec(write_config(tmp_path, [1, 2]))


def test_missing_file_and_directory_without_config(tmp_path):
    with pytest.raises(SpecError, match="no such file"):
        load_spec(tmp_path / "absent" / "config.json")
    with pytest.raises(SpecError, match=f"{tmp_path}: directory has no config.json"):
        load_spec(tmp_path)


def test_unknown_builtin_suggests_close_names():
    with pytest.raises(SpecError, match=r"did you mean llama-3\.2-1b") as e:
        load_spec("llama-3.2-1bb")
    assert "built-in: " in str(e.value)
    with pytest.raises(SpecError) as e:
        load_spec("zzzz")
    assert "did you mean" not in str(e.value) and "qwen3-8b" in str(e.value)


def test_unsupported_model_type_lists_the_supported(tmp_path):
    path = write_config(tmp_path, {**config("llama-tiny"), "model_type": "gpt2"})
    with pytest.raises(SpecError) as e:
        load_spec(path)
    msg = str(e.value)
    assert str(path) in msg and "'model_type'" in msg and "'gpt2'" in msg
    for t in ("llama", "qwen3", "qwen3_moe", "deepseek_v3", "deepseek_v32", "glm_moe_dsa"):
        assert t in msg


def test_missing_model_type(tmp_path):
    cfg = config("llama-tiny")
    del cfg["model_type"]
    with pytest.raises(SpecError, match="'model_type': required"):
        load_spec(write_config(tmp_path, cfg))


# (built-in to start from, config changes, the field the error must name, text it must contain)
BAD = [
    ("llama-tiny", {"hidden_size": None}, "hidden_size", "required but missing"),
    ("llama-tiny", {"vocab_size": None}, "vocab_size", "required but missing"),
    ("llama-tiny", {"hidden_size": "big"}, "hidden_size", "expected int"),
    ("llama-tiny", {"hidden_size": 0}, "hidden_size", "must be positive"),
    ("llama-tiny", {"intermediate_size": -4}, "intermediate_size", "must be positive"),
    ("llama-tiny", {"num_hidden_layers": 0}, "num_hidden_layers", "must be positive"),
    ("llama-tiny", {"num_key_value_heads": 3}, "num_key_value_heads", "does not divide"),
    ("llama-tiny", {"head_dim": None, "num_attention_heads": 5}, "num_attention_heads",
     "does not divide hidden_size 64"),
    ("llama-tiny", {"head_dim": 15}, "head_dim", "must be even"),
    ("llama-tiny", {"rope_theta": None}, "rope_theta", "required"),
    ("llama-tiny", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     "rope_scaling.rope_type", "unsupported RoPE type"),
    ("llama-tiny", {"rope_scaling": {**config("llama-tiny")["rope_scaling"],
                                     "high_freq_factor": 1.0}},
     "rope_scaling.high_freq_factor", "must exceed low_freq_factor"),
    ("qwen3-moe-tiny", {"num_experts_per_tok": 9}, "num_experts_per_tok",
     "exceeds num_experts 8"),
    ("deepseek-v3-tiny", {"num_experts_per_tok": 9}, "num_experts_per_tok",
     "exceeds n_routed_experts 8"),
    ("deepseek-v3-tiny", {"n_group": 3}, "n_group", "does not divide n_routed_experts 8"),
    ("deepseek-v3-tiny", {"topk_group": 5}, "topk_group", "exceeds n_group 4"),
    ("deepseek-v3-tiny", {"num_experts_per_tok": 5}, "num_experts_per_tok",
     "cannot be chosen from topk_group 2 groups of 2"),
    ("deepseek-v3-tiny", {"first_k_dense_replace": -1}, "first_k_dense_replace",
     "must not be negative"),
    ("deepseek-v3-tiny", {"kv_lora_rank": 0}, "kv_lora_rank", "positive"),
    ("deepseek-v3-tiny", {"qk_rope_head_dim": 7}, "qk_rope_head_dim", "even"),
    ("deepseek-v3.2-tiny", {"index_topk": 0}, "index_topk", "positive"),
    ("deepseek-v3.2-tiny", {"index_head_dim": 4}, "index_head_dim", "qk_rope_head_dim"),
    ("glm-5-tiny", {"index_n_heads": -1}, "index_n_heads", "positive"),
    ("glm-5-tiny", {"topk_group": 2}, "topk_group", "exceeds n_group 1"),
]


@pytest.mark.parametrize(("base", "changes", "key", "text"), BAD,
                         ids=[f"{b}-{k}" for b, _, k, _ in BAD])
def test_bad_config_names_field_and_file(tmp_path, base, changes, key, text):
    cfg = {**config(base), **changes}
    path = write_config(tmp_path, {k: v for k, v in cfg.items() if v is not None})
    with pytest.raises(SpecError) as e:
        load_spec(path)
    msg = str(e.value)
    assert str(path) in msg and f"{key!r}" in msg and text in msg, msg
