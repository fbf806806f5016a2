"""`tilertc bench --per-layer` without a GPU: the variants the layers are timed with, the
arithmetic of a layer's time, bytes and the 8-GPU projection on planted timings, the report and
the command line (with `run_bench` standing in for the GPU); then, marked `gpu`, a real run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from rich.console import Console

import tilertc.bench_layers as bl
from tilertc import load_spec, schedule
from tilertc.bench import BenchConfig, BenchError
from tilertc.bench_layers import (
    LAYER_VOCAB,
    KindCosts,
    LayerTiming,
    Projection,
    ShardCost,
    VariantRun,
    device_weight_bytes,
    kind_costs,
    layer_kinds,
    layer_timing,
    layers_to_time,
    project,
    scaled_ms,
    shard_cost,
    variant_overrides,
    variant_spec,
)
from tilertc.bench_report import BenchReport, Prediction, Timing, make_point, token_bytes
from tilertc.cli import main
from tilertc.ir.build import build_graph
from tilertc.model_specs.hf import with_weight_dtype
from tilertc.passes.cost import ATTENTION_CHAIN_NS, BOUNDARY_NS, MLA_CHAIN_NS


def cli(*args: str) -> Result:
    result = CliRunner().invoke(main, list(args))
    assert "Traceback" not in result.output
    return result


def config(model: str, **kw) -> BenchConfig:
    return BenchConfig(model, ((64, 32),), Path("unused"), systems=("tilertc",), **kw)


# -- the variants ---------------------------------------------------------------------------------
def moe_layers(spec) -> list[bool]:
    return [spec.is_moe_layer(i) for i in range(spec.num_layers)]


def test_deepseek_v32_variants_have_the_asked_layers_at_full_width() -> None:
    spec = load_spec("deepseek-v3.2")
    assert layer_kinds(spec) == {"dense": 3, "moe": 58}
    cfg = config("deepseek-v3.2")
    for layers in (1, 5):
        moe = variant_spec(cfg, spec, "moe", layers)
        assert moe.num_layers == layers and moe_layers(moe) == [True] * layers
        dense = variant_spec(cfg, spec, "dense", layers)
        assert dense.num_layers == layers and moe_layers(dense) == [False] * layers
        for v in (moe, dense):
            assert v.vocab_size == LAYER_VOCAB
            assert (v.hidden_size, v.intermediate_size, v.num_heads) == (7168, 18432, 128)
            assert v.moe.num_experts == 256 and v.moe.experts_per_token == 8
            assert v.mla == spec.mla and v.indexer == spec.indexer
            assert v.weight_format == spec.weight_format  # the published FP8 format
    assert variant_spec(cfg, spec, "moe", 1, small_vocab=False).vocab_size == 129280
    assert variant_spec(config("deepseek-v3.2", weight_dtype="bf16"), spec, "moe",
                        1).weight_format.dtype == "bf16"


def test_per_layer_lists_are_cut_to_the_variant() -> None:
    """GLM-5 with its per-layer lists (dense/sparse MLP, shared indexer selections): the
    variants drop them, every layer of a kind, every layer with its own indexer."""
    overrides = {"mlp_layer_types": ["dense"] * 3 + ["sparse"] * 75,
                 "index_topk_pattern": "F" + "FS" * 38 + "S"}
    spec = load_spec("glm-5", overrides)
    assert layer_kinds(spec) == {"dense": 3, "moe": 75} and spec.indexer.shared_layers
    cfg = config("glm-5", overrides=tuple(overrides.items()))
    for kind in ("dense", "moe"):
        v = variant_spec(cfg, spec, kind, 3)
        assert moe_layers(v) == [kind == "moe"] * 3
        assert v.indexer.shared_layers == ()
    tiny = load_spec("glm-5-tiny")
    assert variant_spec(config("glm-5-tiny"), tiny, "moe", 3).indexer.shared_layers == ()


def test_dense_only_and_qwen3_moe_kinds() -> None:
    assert layer_kinds(load_spec("llama-3.2-1b")) == {"dense": 16}
    assert layer_kinds(load_spec("qwen3-30b-a3b")) == {"moe": 48}
    mixed = load_spec("qwen3-moe-tiny", {"num_hidden_layers": 4, "mlp_only_layers": [0, 2]})
    assert layer_kinds(mixed) == {"dense": 2, "moe": 2}
    cfg = config("qwen3-moe-tiny")
    assert moe_layers(variant_spec(cfg, mixed, "dense", 3)) == [False] * 3
    assert moe_layers(variant_spec(cfg, mixed, "moe", 3)) == [True] * 3
    # a vocabulary smaller than LAYER_VOCAB stays as it is
    assert variant_spec(cfg, mixed, "moe", 1).vocab_size == mixed.vocab_size == 256


def test_a_variant_of_the_wrong_kind_is_refused(monkeypatch) -> None:
    spec = load_spec("deepseek-v3-tiny")

    def without_first_dense(spec, kind, layers):  # first_k_dense_replace left at the model's
        return {"num_hidden_layers": layers}

    monkeypatch.setattr(bl, "kind_overrides", without_first_dense)
    with pytest.raises(BenchError, match="moe variant of 2 layer.* came out as"):
        variant_overrides(config("deepseek-v3-tiny"), spec, "moe", 2)


# -- what fits the GPU ----------------------------------------------------------------------------
def test_device_bytes_of_bf16_weights() -> None:
    """bf16: the packed copy and the interpreter's are the stored bytes each; one op's weights
    are widened to fp32 (twice their bytes) while it runs, the largest op's at most, but for
    the routed experts' op, which widens one expert at a time."""
    spec = load_spec("qwen3-moe-tiny")
    graph = build_graph(spec, 96)
    stored = graph.weight_bytes()
    per_op = {op.opcode: sum(graph.tensors[i].nbytes for i in op.inputs
                             if graph.tensors.get(i) in graph.weights()) for op in graph.ops()}
    assert max(per_op.values()) == per_op["moe_experts"]  # the experts: the largest op here
    largest = max(n for opcode, n in per_op.items() if opcode != "moe_experts")
    assert device_weight_bytes(spec, 96) == 2 * stored + 2 * largest


def test_fp8_weights_stay_fp8_on_the_device_and_are_widened_per_op() -> None:
    """FP8: both copies are the stored bytes (e4m3 values and their scales); the largest op's
    weights are widened to fp32 (4 bytes a value, FP8 ones dequantized) while it runs."""
    spec = with_weight_dtype(load_spec("llama-tiny"), "fp8")
    graph = build_graph(spec, 96)
    scales = {t.attrs["scale_inv"] for t in graph.weights() if "scale_inv" in t.attrs}
    stored = graph.weight_bytes()
    largest = max(sum(4 * graph.tensors[i].numel for i in op.inputs
                      if graph.tensors.get(i) in graph.weights() and i not in scales
                      and graph.tensors[i].dtype != "fp32")
                  for op in graph.ops())
    assert device_weight_bytes(spec, 96) == 2 * stored + largest


def test_what_fits_of_full_size_deepseek_moe_layers() -> None:
    """The figures docs/performance.md gives for 1 + 1 and 1 + 2 MoE layers: DeepSeek-V3.2
    bf16 95 and 141 GB, FP8 49 and 72 GB; GLM-5 bf16 81 and 121 GB."""
    spec = load_spec("deepseek-v3.2")
    for dtype, two, three in (("bf16", 95, 141), ("fp8", 49, 72)):
        cfg = config("deepseek-v3.2", weight_dtype=dtype)
        for layers, gb in ((2, two), (3, three)):
            got = device_weight_bytes(variant_spec(cfg, spec, "moe", layers), 1280)
            assert got == pytest.approx(gb * 1e9, abs=0.5e9)
    glm = load_spec("glm-5")
    for layers, gb in ((2, 81), (3, 121)):
        got = device_weight_bytes(variant_spec(config("glm-5"), glm, "moe", layers), 1280)
        assert got == pytest.approx(gb * 1e9, abs=0.5e9)


def test_layers_to_time() -> None:
    def need(n: int) -> int:  # 10 GB of embedding and lm_head, 20 GB per layer
        return 10 + 20 * (1 + n)

    assert layers_to_time(need, 1000, None, "x") == bl.LAYERS_TIMED
    assert layers_to_time(need, 70, None, "x") == 2  # 1 + 2 layers, 70 GB
    assert layers_to_time(need, 1000, 7, "x") == 7
    with pytest.raises(BenchError, match="1 \\+ 4 moe layers need 110 B .*--layers-timed 2 fits"):
        layers_to_time(need, 70, 4, "moe layers")
    with pytest.raises(BenchError, match="1 \\+ 1 x need 50 B.*--weight-dtype fp8"):
        layers_to_time(need, 49, None, "x")


# -- a layer's figures ----------------------------------------------------------------------------
def test_layer_time_bytes_and_prediction_are_differences_over_n() -> None:
    one = VariantRun(1, 1.0, 500_000_000, 10_000_000, 0.9, 4.0e12)
    more = VariantRun(5, 3.0, 4_500_000_000, 50_000_000, 2.5, 4.2e12)
    t = layer_timing("moe", 58, one, more)
    assert t.layers_timed == 4 and t.ms == pytest.approx(0.5) and t.base_ms == 1.0
    assert t.weight_bytes == pytest.approx(1e9) and t.kv_bytes == pytest.approx(1e7)
    assert t.ceiling_bytes_per_s == pytest.approx(4.1e12)
    assert t.roofline_ms == pytest.approx(1.01e9 / 4.1e12 * 1e3)
    assert t.roofline_pct == pytest.approx(100 * 1.01e9 / 0.5e-3 / 4.1e12)
    assert t.predicted_ms == pytest.approx(0.4)
    assert t.to_dict()["target_pct"] == 75.0
    # 0.5 ms against a roofline of 0.2463 ms: 75 % would be 0.3285 ms, 171.5 µs less
    assert t.us_to_target == pytest.approx(171.5, abs=0.1)
    assert t.to_dict()["us_to_target"] == t.us_to_target
    met = LayerTiming("dense", 3, 4, 0.3, 1.0, 1e9, 0, 4e12, 0.3)  # 83 % of 0.25 ms
    assert met.roofline_pct > 75 and met.us_to_target == 0
    with pytest.raises(BenchError, match="no positive time per layer"):
        layer_timing("moe", 58, one, VariantRun(5, 0.99, 4_500_000_000, 0, 2.5, 4e12))


def test_variant_run_takes_the_mean_time_per_token() -> None:
    nbytes = token_bytes(load_spec("llama-tiny"), 64, 32)
    point = make_point(64, 32, nbytes, 4e12, {"tilertc": Timing(0.01, 0.1, 31, ms_mean=0.05)},
                       prediction=Prediction(0.04, 0.02, 80))
    report = BenchReport({}, {}, {}, "random bf16", {"bytes_per_s": 4e12}, {}, [point])
    run = VariantRun.from_report(3, report)
    assert (run.layers, run.ms, run.predicted_ms) == (3, 0.05, 0.04)
    assert (run.weight_bytes, run.kv_bytes) == (nbytes.weights, nbytes.kv)


# -- the projection -------------------------------------------------------------------------------
def test_shard_cost_counts_bytes_ops_and_allreduces() -> None:
    spec = load_spec("llama-tiny")
    one, two = shard_cost(spec, 1, 80), shard_cost(spec, 2, 80)
    program = schedule(spec, "h200", 1, 80)
    ops = program.graph.ops()
    assert one.bytes == sum(t.weight_bytes + t.other_bytes for t in program.tasks)
    assert one.fixed_ns == BOUNDARY_NS * len(ops) + ATTENTION_CHAIN_NS * spec.num_layers
    assert one.allreduces == 0 and two.allreduces == 2 * spec.num_layers
    assert two.bytes < one.bytes
    mla = load_spec("deepseek-v3-tiny")  # MLA: its chain once per layer
    ops = schedule(mla, "h200", 1, 80).graph.ops()
    assert shard_cost(mla, 1, 80).fixed_ns == pytest.approx(
        BOUNDARY_NS * len(ops) + MLA_CHAIN_NS * mla.num_layers)
    diff = ShardCost(10.0, 7.0, 3.0).minus(ShardCost(4.0, 1.0, 1.0), 2)
    assert diff == ShardCost(3.0, 3.0, 1.0)


def test_scaled_ms() -> None:
    at1, at8 = ShardCost(1e9, 30_000, 0), ShardCost(2e8, 30_000, 2)
    # 0.53 ms measured: 0.03 fixed stays, 0.5 scales by 1/5, two all-reduces of 10 µs.
    assert scaled_ms(0.53, at1, at8, 10.0) == pytest.approx(0.03 + 0.1 + 0.02)
    # below the fixed time nothing scales
    assert scaled_ms(0.02, at1, at8, 10.0) == pytest.approx(0.03 + 0.02)


def planted_projection(model: str = "deepseek-v3.2") -> Projection:
    timings = [LayerTiming("dense", 3, 4, 0.4, 0.6, 1e9, 0, 4e12, 0.3),
               LayerTiming("moe", 58, 1, 0.5, 0.8, 1.2e9, 0, 4e12, 0.35)]
    cost = KindCosts(layer_tp1=ShardCost(1.2e9, 30_000, 0), layer_tp=ShardCost(2e8, 30_000, 2),
                     rest_tp1=ShardCost(4e8, 9_000, 0), rest_tp=ShardCost(2e8, 9_000, 1))
    return project(timings, {"dense": cost, "moe": cost}, 10.0, model)


def test_projection_on_planted_timings() -> None:
    p = planted_projection()
    rest, dense, moe = p.parts
    # the rest: T(1) - one layer, 0.2 ms (dense) and 0.3 ms (moe), averaged
    assert rest.measured_ms == pytest.approx(0.25)
    assert rest.projected_ms == pytest.approx(
        ((0.009 + 0.191 / 2 + 0.01) + (0.009 + 0.291 / 2 + 0.01)) / 2)
    assert dense.count == 3 and dense.projected_ms == pytest.approx(0.03 + 0.37 / 6 + 0.02)
    assert moe.count == 58 and moe.projected_ms == pytest.approx(0.03 + 0.47 / 6 + 0.02)
    assert p.total_ms == pytest.approx(rest.projected_ms + 3 * dense.projected_ms
                                       + 58 * moe.projected_ms)
    # the bound: each part's time above its roofline (bytes at 4 TB/s) stays; the roofline
    # scales with the bytes a rank reads. dense: 0.4 ms over a 0.25 ms roofline, 1/6 of the
    # bytes per rank; moe: 0.5 over 0.3; the rest: 0.2 and 0.3 over 0.1, half the bytes.
    assert dense.excess_fixed_ms == pytest.approx(0.15 + 0.25 / 6 + 0.02)
    assert moe.excess_fixed_ms == pytest.approx(0.2 + 0.3 / 6 + 0.02)
    assert rest.excess_fixed_ms == pytest.approx(((0.1 + 0.05 + 0.01) + (0.2 + 0.05 + 0.01)) / 2)
    assert p.excess_fixed_total_ms == pytest.approx(
        rest.excess_fixed_ms + 3 * dense.excess_fixed_ms + 58 * moe.excess_fixed_ms)
    assert all(part.excess_fixed_ms >= part.projected_ms for part in p.parts)
    # where the cost model's fixed time exceeds the measured excess, the projection is the bound
    timings = [LayerTiming("dense", 3, 4, 0.26, 0.4, 1e9, 0, 4e12, 0.3)]
    cost = KindCosts(layer_tp1=ShardCost(1e9, 30_000, 0), layer_tp=ShardCost(2e8, 30_000, 2),
                     rest_tp1=ShardCost(4e8, 9_000, 0), rest_tp=ShardCost(2e8, 9_000, 1))
    tight_rest, tight = project(timings, {"dense": cost}, 10.0, "deepseek-v3.2").parts
    assert tight.excess_fixed_ms == pytest.approx(tight.projected_ms)  # 0.01 excess < 0.03 fixed
    assert tight_rest.excess_fixed_ms >= tight_rest.projected_ms
    d = p.to_dict()
    assert d["label"] == "projection, not a measurement" and d["tp"] == 8
    assert d["tokens_per_s"] == pytest.approx(1e3 / p.total_ms)
    assert d["excess_fixed_total_ms"] == pytest.approx(p.excess_fixed_total_ms)
    assert [x["model"] for x in d["published"]] == ["deepseek-v3.2"]
    assert {x["model"] for x in planted_projection("glm-5").to_dict()["published"]} == {"glm-5"}
    assert planted_projection("llama-3.2-1b").published == []


def test_kind_costs_of_full_size_deepseek() -> None:
    """The cost model's programs: a layer's bytes per rank shrink at tp 8 and it gains two
    all-reduces; the rest is read at the model's vocabulary with the argmax's exchange."""
    spec = load_spec("deepseek-v3.2")
    cfg = config("deepseek-v3.2", weight_dtype="bf16")
    costs = kind_costs(lambda *a: variant_spec(cfg, spec, "moe", *a), 1, 1152)
    assert costs.layer_tp1.allreduces == 0 and costs.layer_tp.allreduces == 2
    assert costs.layer_tp.bytes < costs.layer_tp1.bytes / 3
    assert costs.rest_tp.allreduces == 1 and costs.rest_tp1.allreduces == 0
    # lm_head at 129280 rows / 8 ranks against 32000 rows on one GPU
    assert costs.rest_tp.bytes == pytest.approx(costs.rest_tp1.bytes * 129280 / 8 / 32000,
                                                rel=0.05)


def test_tiny_models_have_no_tp8_projection() -> None:
    spec = load_spec("deepseek-v3-tiny")
    cfg = config("deepseek-v3-tiny")
    why = bl.projection_costs([("moe", 1)],
                              lambda kind, *a: variant_spec(cfg, spec, kind, *a), 80)
    assert isinstance(why, str) and "--tp 8" in why


# -- the command line, `run_bench` standing in for the GPU ----------------------------------------
def planted_run_bench(calls: list[BenchConfig]):
    """`run_bench` for a variant: 0.2 ms of embedding, lm_head and sampling, then 0.1 ms per
    dense layer and 0.15 per MoE layer; bytes and prediction as the bench computes them."""

    def run(cfg: BenchConfig, phase) -> tuple[BenchReport, None]:
        calls.append(cfg)
        with phase("timing"):
            pass
        spec = with_weight_dtype(load_spec(cfg.model, dict(cfg.overrides)), cfg.weight_dtype)
        moe = sum(moe_layers(spec))
        ms = 0.2 + 0.1 * (spec.num_layers - moe) + 0.15 * moe
        (context, gen), = cfg.points
        nbytes = token_bytes(spec, context, gen)
        point = make_point(context, gen, nbytes, 4e12,
                           {"tilertc": Timing(ms, ms, gen - 1, ms_mean=ms)},
                           prediction=Prediction(0.8 * ms, 0.5 * ms, nbytes.kv_context))
        return BenchReport({"name": spec.name, "spec_hash": spec.content_hash()}, {},
                           {"name": "planted"}, "random bf16 (seed 0)",
                           {"bytes_per_s": 4e12, "method": "planted"}, {}, [point]), None

    return run


@pytest.fixture
def planted_gpu(monkeypatch) -> list[BenchConfig]:
    calls: list[BenchConfig] = []
    monkeypatch.setattr(bl, "run_bench", planted_run_bench(calls))
    monkeypatch.setattr(bl, "require_gpu", lambda device: None)
    monkeypatch.setattr(bl, "free_bytes", lambda device: 140e9)
    return calls


def test_per_layer_command_times_each_kind_by_difference(planted_gpu, tmp_path: Path) -> None:
    result = cli("bench", "deepseek-v3-tiny", "--per-layer", "--layers-timed", "2",
                 "--context", "64", "--gen", "32", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    runs = [(dict(c.overrides)["num_hidden_layers"], dict(c.overrides)["first_k_dense_replace"])
            for c in planted_gpu]
    assert runs == [(1, 1), (3, 3), (1, 0), (3, 0)]  # dense 1 and 3, MoE 1 and 3
    assert all(c.systems == ("tilertc",) and c.points == ((64, 32),) for c in planted_gpu)
    assert [c.out.name for c in planted_gpu] == ["dense-1", "dense-3", "moe-1", "moe-3"]
    d = json.loads((tmp_path / "bench.json").read_text())
    kinds = {k["kind"]: k for k in d["per_layer"]["kinds"]}
    assert kinds["dense"]["ms"] == pytest.approx(0.1) and kinds["dense"]["count"] == 1
    assert kinds["moe"]["ms"] == pytest.approx(0.15) and kinds["moe"]["count"] == 2
    assert kinds["moe"]["predicted_ms"] == pytest.approx(0.8 * 0.15)
    assert set(d["runs"]) == {"dense-1", "dense-3", "moe-1", "moe-3"}
    assert "--tp 8" in d["per_layer"]["projection"]["unavailable"]  # 4 heads
    assert "no projection on 8 GPUs" in result.output and "ms/layer" in result.output
    assert "deepseek-v3-tiny on planted, one layer of each kind" in result.output  # the GPU named
    assert "µs to target" in result.output


def test_per_layer_command_projects_a_full_size_model(planted_gpu, tmp_path: Path) -> None:
    result = cli("bench", "glm-5", "--per-layer", "--context", "64", "--gen", "32",
                 "--allreduce-us", "5", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    # three bf16 MoE layers fit 140 GB less a tenth (121 GB), not four: N = 2; dense N = 4
    assert [c.out.name for c in planted_gpu] == ["dense-1", "dense-5", "moe-1", "moe-3"]
    d = json.loads((tmp_path / "bench.json").read_text())
    p = d["per_layer"]["projection"]
    assert p["label"] == "projection, not a measurement" and p["allreduce_us"] == 5
    assert [part["count"] for part in p["parts"]] == [1, 3, 75]
    assert p["total_ms"] == pytest.approx(sum(part["count"] * part["projected_ms"]
                                              for part in p["parts"]))
    assert len(p["published"]) == 2
    assert "PROJECTION, not a measurement" in result.output
    assert "301 tokens/s" in result.output


@pytest.mark.parametrize(("args", "message"), [
    (["--systems", "tilertc,hf-eager"], "tilertc only"),
    (["--points", "1k/1k,2k/1k"], "one point"),
    (["--profile"], "no --profile"),
    (["--tp", "2"], "one GPU"),
    (["--backend", "cuda,tilelang"], "one backend"),
])
def test_per_layer_refuses_what_it_cannot_do(args: list[str], message: str,
                                             planted_gpu) -> None:
    result = cli("bench", "llama-tiny", "--per-layer", *args)
    assert result.exit_code == 1 and message in result.output
    assert planted_gpu == []


def test_per_layer_refuses_an_artifact_and_checkpoint(planted_gpu, tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text("{}")
    result = cli("bench", str(tmp_path), "--per-layer")
    assert result.exit_code == 1 and "not an artifact directory" in result.output
    result = cli("bench", "llama-tiny", "--per-layer", "--weights", str(tmp_path))
    assert result.exit_code == 1 and "random weights only" in result.output


def test_per_layer_options_need_per_layer() -> None:
    result = cli("bench", "llama-tiny", "--layers-timed", "2")
    assert result.exit_code == 2 and "go with --per-layer" in result.output
    assert "--per-layer" in cli("bench", "--help").output


def test_report_says_projection(planted_gpu, tmp_path: Path) -> None:
    console = Console(width=200, record=True)
    bl.print_projection(planted_projection(), "deepseek-v3.2", console)
    text = console.export_text()
    assert "PROJECTION, not a measurement" in text and "assumed 10 µs" in text
    bound = planted_projection().excess_fixed_total_ms
    assert "if the excess is fixed" in text and f"{bound:.3f}" in text
    assert "TileRT v0.1.1, DeepSeek-V3.2-Exp, 8x B200" in text and "perf.png" in text
    console = Console(width=200, record=True)
    bl.print_projection(planted_projection("llama-3.2-1b"), "llama-3.2-1b", console)
    assert "not found for this model" in console.export_text()


# -- on the GPU -----------------------------------------------------------------------------------
@pytest.mark.gpu
def test_per_layer_on_gpu(tmp_path: Path) -> None:
    """deepseek-v3-tiny's dense and MoE layers, each kind by 1 vs 3 layers through the gate."""
    result = cli("bench", "deepseek-v3-tiny", "--per-layer", "--layers-timed", "2",
                 "--context", "64", "--gen", "256", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    d = json.loads((tmp_path / "bench.json").read_text())
    assert set(d["runs"]) == {"dense-1", "dense-3", "moe-1", "moe-3"}
    assert all(r["gate"]["passed"] for r in d["runs"].values())
    for k in d["per_layer"]["kinds"]:
        assert k["ms"] > 0 and k["bytes"] > 0 and k["roofline_pct"] > 0, k
