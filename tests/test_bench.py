"""`tilertc bench` without a GPU: the report's arithmetic, bench.json, the charts, the
correctness gate, the profile table, the command line; then, marked `gpu`, the real runs.

Everything a report says is computed from timings, byte counts and stamps by pure functions,
so these tests feed them hand-made inputs whose answers are known.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner, Result
from rich.console import Console

from tilertc import load_spec, schedule
from tilertc.backends.cuda import encode
from tilertc.bench import (
    GATE_STEPS,
    BenchConfig,
    BenchError,
    check_model,
    check_room,
    finish,
    op_bytes,
    parse_backends,
    parse_points,
    parse_systems,
    parse_tuning,
    prediction,
    quiet_phase,
    rescheduled,
    resolve_artifacts,
    run_gate,
    stage_phases,
    time_baseline,
)
from tilertc.bench_gate import (
    MIN_CLEAR_STEPS,
    GateFailure,
    check_decode,
    clear_margins,
    depth_tolerance,
)
from tilertc.bench_report import (
    BenchReport,
    Prediction,
    Timing,
    TokenBytes,
    arrival_intervals,
    make_point,
    print_point,
    roofline_pct,
    token_bytes,
)
from tilertc.cli import main
from tilertc.engine import device_bytes
from tilertc.inspect import inspect_model
from tilertc.ir.target import get_target
from tilertc.model_specs.hf import with_weight_dtype
from tilertc.passes.tiling import has_tiles
from tilertc.profile import (
    StepProfile,
    fold_layer,
    op_table,
    print_op_table,
    task_ctas,
    task_ops,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def cli(*args: str) -> Result:
    result = CliRunner().invoke(main, list(args))
    assert "Traceback" not in result.output
    return result


# -- timings and the figures derived from them ---------------------------------------------------
def test_timing_statistics() -> None:
    t = Timing.from_seconds([0.002] * 9 + [0.012])
    assert t.ms_median == pytest.approx(2.0)
    assert t.ms_p90 == pytest.approx(3.0)  # numpy's linear interpolation between 2 and 12
    assert t.ms_mean == pytest.approx(3.0)
    assert t.tokens == 10 and t.tokens_per_s == pytest.approx(500.0)
    with pytest.raises(ValueError):
        Timing.from_seconds([])


def test_batched_arrivals_are_flagged() -> None:
    # A 30 µs step polled every 90 µs: tokens arrive three at a time.
    bursts = Timing.from_seconds([90e-6, 1e-6, 1e-6] * 20)
    assert bursts.batched_arrivals
    assert not Timing.from_seconds([1e-3, 1.1e-3, 0.9e-3]).batched_arrivals
    assert not Timing(1.0, 1.2, 10).batched_arrivals  # no raw times, nothing to judge


def test_arrival_intervals() -> None:
    assert arrival_intervals(10.0, [10.5, 11.0, 12.0]) == pytest.approx([0.5, 0.5, 1.0])
    with pytest.raises(ValueError, match="decrease"):
        arrival_intervals(10.0, [11.0, 10.5])


def test_roofline_pct() -> None:
    # 2 GB per token in 1 ms is 2 TB/s: half of a 4 TB/s ceiling.
    assert roofline_pct(2_000_000_000, 1.0, 4e12) == pytest.approx(50.0)


def synthetic_point(prediction_: Prediction | None = None):
    nbytes = TokenBytes(weights=3_000_000_000, kv=1_000_000_000, kv_context=1536)
    results = {"tilertc": Timing(1.25, 1.4, 100), "hf-eager": Timing(20.0, 25.0, 100),
               "hf-graph": "needs transformers", "kernel-per-op": Timing(2.5, 2.6, 100)}
    return make_point(1024, 1024, nbytes, 4e12, results, {"tilertc": "kernel"}, prediction_)


def test_point_roofline_and_speedups() -> None:
    point = synthetic_point()
    assert point.roofline_ms == pytest.approx(1.0)  # 4 GB at 4 TB/s
    tilertc, eager = point.row("tilertc"), point.row("hf-eager")
    assert tilertc.roofline_pct == pytest.approx(80.0)
    assert eager.roofline_pct == pytest.approx(5.0)
    assert tilertc.speedup_vs == pytest.approx({"hf-eager": 16.0, "kernel-per-op": 2.0})
    assert eager.speedup_vs["tilertc"] == pytest.approx(1 / 16)
    skipped = point.row("hf-graph")
    assert skipped.timing is None and skipped.skipped == "needs transformers"
    assert "hf-graph" not in tilertc.speedup_vs


def test_token_bytes_are_inspect_bytes_at_the_mean_context() -> None:
    spec = load_spec("llama-tiny")
    got = token_bytes(spec, context=64, gen=32)
    want = inspect_model(spec, get_target("h200"), max_seq_len=80).totals
    assert got.kv_context == 80
    assert got.weights == want["weight_bytes_per_token"]
    assert got.kv == want["kv_bytes_per_token"]
    assert got.total == got.weights + got.kv
    assert token_bytes(spec, 128, 32).kv > got.kv  # KV reads grow with the context


def test_prediction_uses_the_artifact_schedule_at_the_point_context() -> None:
    spec = load_spec("llama-tiny")
    m = {"options": {"tp": 1, "compute_warps": None, "page_kb": None, "page_groups": None},
         "target": {"name": "h200"}, "weights": {"layout": [{"format": "bf16"}]}}
    p = prediction(rescheduled(spec, m, 80), 80)
    from tilertc.passes.cost import step_ns

    assert p.context == 80
    assert p.step_ms == pytest.approx(step_ns(schedule(spec, "h200", 1, 80)) / 1e6)
    assert 0 < p.roofline_ms < p.step_ms


@pytest.mark.parametrize(("name", "tiles"), [("qwen3-30b-a3b", True), ("llama-3.1-8b", False)])
def test_prediction_keeps_the_artifacts_fp8_tiles_or_rows(name: str, tiles: bool) -> None:
    """The compile chose tiles or rows at its max_seq_len (make_program); the point's schedule
    keeps what the artifact has, here the other way from what the comparison would pick now."""
    spec = with_weight_dtype(load_spec(name, overrides={"num_hidden_layers": 2}), "fp8")
    m = {"options": {"tp": 1, "fp8_mma": None}, "target": {"name": "h200"},
         "weights": {"layout": [{"format": "fp8_e4m3", **({"tiles": True} if tiles else {})}]}}
    chosen, kept = schedule(spec, "h200", 1, 80), rescheduled(spec, m, 80)
    assert has_tiles(chosen) != tiles and has_tiles(kept) == tiles


def test_report_json_schema(tmp_path: Path) -> None:
    report = synthetic_report([synthetic_point(Prediction(1.1, 0.9, 1536))])
    d = json.loads(json.dumps(report.to_dict()))
    assert d["schema_version"] == 2
    for key in ("tilertc_version", "created", "command", "model", "artifact", "device",
                "weights", "ceiling", "gate", "points", "profile"):
        assert key in d
    (point,) = d["points"]
    assert point["context"] == 1024 and point["gen"] == 1024
    assert point["bytes_per_token"] == {"weights": 3_000_000_000, "kv": 1_000_000_000,
                                        "total": 4_000_000_000, "kv_context": 1536}
    assert point["roofline_ms_per_token"] == pytest.approx(1.0)
    assert point["prediction"] == {"step_ms": 1.1, "roofline_ms": 0.9, "context": 1536}
    systems = {s["name"]: s for s in point["systems"]}
    assert list(systems) == ["tilertc", "hf-eager", "hf-graph", "kernel-per-op"]
    ok = systems["tilertc"]
    assert ok["status"] == "ok"
    for key in ("ms_per_token_median", "ms_per_token_p90", "ms_per_token_mean", "tokens_timed",
                "tokens_per_s_per_user", "roofline_pct", "speedup_vs"):
        assert key in ok
    assert ok["tokens_per_s_per_user"] == pytest.approx(800.0)
    assert systems["hf-graph"] == {"name": "hf-graph", "detail": "", "status": "skipped",
                                   "reason": "needs transformers"}


def synthetic_report(points) -> BenchReport:
    gate = check_decode(*planted_run()[:3]).to_dict()
    return BenchReport(model={"name": "llama-tiny", "spec_hash": "x"},
                       artifact={"path": "a", "hash": "h", "max_seq_len": 2048, "options": {}},
                       device={"name": "test GPU", "torch": torch.__version__, "cuda": None},
                       weights="random bf16 (seed 0)",
                       ceiling={"bytes_per_s": 4e12, "method": "test"}, gate=gate,
                       points=points, command="tilertc bench llama-tiny", created="now")


# -- the correctness gate --------------------------------------------------------------------
def planted_run(steps: int = 8, vocab: int = 50):
    """Reference logits with a clear winner per step, the kernel's a little off them, and the
    kernel's tokens (the winners)."""
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(steps, vocab, generator=gen)
    winners = torch.randint(0, vocab, (steps,), generator=gen)
    ref[torch.arange(steps), winners] = 10.0
    kernel = ref + 1e-3 * torch.randn(steps, vocab, generator=gen)
    return kernel, ref, winners.tolist()


def test_gate_passes_a_faithful_run() -> None:
    kernel, ref, tokens = planted_run()
    report = check_decode(kernel, ref, tokens, baseline_tokens=tokens, baseline="kpo")
    assert report.passed, report.problems
    assert report.max_rel_err < 2e-2 and report.clear_steps == len(tokens)
    assert report.baseline_tokens_compared == len(tokens)
    assert report.to_dict()["passed"] is True


def test_gate_refuses_wrong_logits() -> None:
    kernel, ref, tokens = planted_run()
    kernel[3] += 0.5 * torch.randn(kernel.shape[1])
    report = check_decode(kernel, ref, tokens)
    assert not report.passed
    assert any(p.startswith("step 3: the kernel's logits differ") for p in report.problems)
    with pytest.raises(GateFailure, match="step 3"):
        raise GateFailure(report)


def test_bench_refuses_a_kernel_that_would_not_fit_beside_those_held() -> None:
    """qwen3-32b FP8 (31 GiB packed) timed three ways with --rounds 2: the third kernel did not
    fit beside the weights and the two loaded; the bench says so before loading it."""
    m = {"weights": {"packed_bytes": 31 << 30}, "arenas": {"act": 1 << 20, "kv": 1 << 28}}
    need = device_bytes(m)
    assert need == (31 << 30) + (4 << 20) + (2 << 28)
    check_room("tilertc", m, need, 0, 1)  # fits exactly
    check_room("tilertc", m, None, 0, 1)  # free memory unknown: not refused
    with pytest.raises(BenchError, match="the kernel needs ~33.8 GB .* 33.8 GB is free") as e:
        check_room("tilertc", m, need - 1, 0, 1)
    assert "--rounds" not in str(e.value)
    with pytest.raises(BenchError, match="--rounds 2 keeps every kernel loaded and 2 already"):
        check_room("tilertc-Q8_mma0", m, 8 << 30, 2, 2)


def test_an_error_between_phases_marks_no_phase_failed() -> None:
    """The refusal above comes after the last kernel's gate, outside any phase: the display
    showed that gate as failed. A finished phase stays done; one that raises is failed."""
    console = Console(record=True, width=100, force_terminal=False)
    with pytest.raises(BenchError), stage_phases(console) as phase:
        with phase("tilertc-A: correctness gate"):
            pass
        raise BenchError("tilertc-B: the kernel needs ~33.5 GB of GPU memory")
    assert "failed" not in console.export_text()
    console = Console(record=True, width=100, force_terminal=False)
    with pytest.raises(BenchError), stage_phases(console) as phase, phase("tilertc-A: gate"):
        raise BenchError("mismatch")
    assert "failed: tilertc-A: gate" in console.export_text()


def test_gate_tolerance_grows_with_depth_as_a_random_walk() -> None:
    """Up to 32 layers 2 %; a 64-layer model's logits may be 2.03 % off (qwen3-32b FP8, as
    measured), not 3 %; the error of a wrong kernel (tens of %) is refused at any depth."""
    kernel, ref, tokens = planted_run()
    noise = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    off = [ref + e * ref.norm(dim=-1, keepdim=True) * noise / noise.norm(dim=-1, keepdim=True)
           for e in (0.0203, 0.03, 0.3)]
    assert depth_tolerance(16) == depth_tolerance(32) == 2e-2
    assert not check_decode(off[0], ref, tokens, rel_tol=depth_tolerance(32)).passed
    assert check_decode(off[0], ref, tokens, rel_tol=depth_tolerance(64)).passed
    assert not check_decode(off[1], ref, tokens, rel_tol=depth_tolerance(64)).passed
    assert not check_decode(off[2], ref, tokens, rel_tol=depth_tolerance(128)).passed
    report = check_decode(off[0], ref, tokens, rel_tol=depth_tolerance(64))
    assert report.to_dict()["rel_tol"] == depth_tolerance(64)


def test_gate_refuses_a_token_that_is_not_the_argmax() -> None:
    kernel, ref, tokens = planted_run()
    tokens[2] = (tokens[2] + 1) % kernel.shape[1]
    problems = check_decode(kernel, ref, tokens).problems
    assert any("step 2: the kernel emitted token" in p for p in problems)


def test_gate_refuses_a_kernel_that_disagrees_with_the_interpreter_on_a_clear_step() -> None:
    kernel, ref, tokens = planted_run()
    other = (tokens[5] + 1) % kernel.shape[1]
    kernel[5, other] = 10.5  # the kernel's logits pick another token, still within tolerance
    tokens[5] = other
    problems = check_decode(kernel, ref, tokens, rel_tol=1.0).problems
    assert any("step 5: the kernel chose token" in p for p in problems)


def test_gate_refuses_a_baseline_that_parts_on_a_clear_margin() -> None:
    kernel, ref, tokens = planted_run()
    baseline = list(tokens)
    baseline[4] = (baseline[4] + 1) % kernel.shape[1]
    report = check_decode(kernel, ref, tokens, baseline, "kernel-per-op-cuda-graph")
    assert report.problems == [f"step 4: kernel-per-op-cuda-graph chose token {baseline[4]}, "
                               f"the kernel {tokens[4]}, with a clear top-2 margin"]
    assert report.baseline_tokens_compared == 4


def test_gate_judges_a_bf16_baseline_by_its_logits() -> None:
    """A baseline whose logits are the interpreter's within a bf16 engine's error may part from
    the kernel even on a clear margin (a flip at its precision): judged by its logits, up to and
    including the parting step; one decoding another model fails on its logits."""
    kernel, ref, tokens = planted_run()
    gen = torch.Generator().manual_seed(1)
    noisy = ref + 0.06 * ref.norm(dim=-1, keepdim=True) / ref.shape[1] ** 0.5 * torch.randn(
        ref.shape, generator=gen)
    parted = [*tokens[:4], (tokens[4] + 1) % ref.shape[1], 0, 0, 0]
    report = check_decode(kernel, ref, tokens, parted, "kpo", baseline_logits=noisy)
    assert report.passed, report.problems
    assert report.baseline_diverged_at == 4 and 0.04 < report.baseline_max_rel_err < 0.08
    other = torch.randn(ref.shape, generator=gen)
    problems = check_decode(kernel, ref, tokens, parted, "kpo", baseline_logits=other).problems
    assert [p.split(":")[0] for p in problems] == [f"step {i}" for i in range(5)]
    assert all("kpo's logits differ" in p for p in problems)


def test_gate_lets_a_baseline_part_on_a_tie() -> None:
    kernel, ref, tokens = planted_run()
    runner_up = (tokens[4] + 1) % kernel.shape[1]
    ref[4, runner_up] = kernel[4, runner_up] = 9.99  # a near tie at step 4
    baseline = [*tokens[:4], runner_up, 0, 0, 0]
    report = check_decode(kernel, ref, tokens, baseline, "kpo")
    assert report.passed, report.problems
    assert report.baseline_diverged_at == 4 and report.baseline_tokens_compared == 4


def test_gate_skips_a_step_routed_otherwise_within_a_tie() -> None:
    """A step whose MoE routing differs within a tie runs other experts by design: its logits
    and token are not compared, and it is reported; the same step without the tie fails."""
    kernel, ref, tokens = planted_run()
    other = (tokens[3] + 1) % kernel.shape[1]
    kernel[3] = 0.5 * torch.randn(kernel.shape[1])
    kernel[3, other] = 12.0
    tokens[3] = other
    tied = [i == 3 for i in range(len(tokens))]
    report = check_decode(kernel, ref, tokens, tied=tied)
    assert report.passed, report.problems
    assert report.tied_steps == [3] and report.clear_steps == len(tokens) - 1
    assert report.max_rel_err < 2e-2
    assert {p.split(":")[0] for p in check_decode(kernel, ref, tokens).problems} == {"step 3"}


def test_gate_needs_clear_steps() -> None:
    flat = torch.zeros(8, 50)
    flat[:, :2] = 1.0  # every step a tie
    report = check_decode(flat, flat, [0] * 8)
    assert any("too few to check greedy tokens" in p for p in report.problems)
    assert clear_margins(flat) == [False] * 8


def test_gate_rejects_misshapen_inputs() -> None:
    with pytest.raises(ValueError, match="one token per step"):
        check_decode(torch.zeros(4, 10), torch.zeros(4, 10), [0, 0])


# -- the kernel's profile -------------------------------------------------------------------------
def synthetic_profile() -> StepProfile:
    """Two steps on two CTAs: embed (1 task), layers.0.mlp and layers.1.mlp (2 tasks each),
    lm_head (1 task). Step 1 is step 0 shifted by 1e18 ns, as globaltimer stamps are."""
    step = np.array([
        [0, 0, 1000],            # embed, CTA 0
        [1000, 1500, 3000],      # layers.0.mlp, CTA 0
        [0, 1500, 2500],         # layers.0.mlp, CTA 1
        [3000, 3500, 4500],      # layers.1.mlp, CTA 0
        [2500, 3000, 5000],      # layers.1.mlp, CTA 1
        [5000, 6000, 7000],      # lm_head, CTA 1
    ], dtype=np.int64)
    stamps = np.stack([step + 10**18, step + 10**18 + 10**7])
    ops = ["embed", "layers.0.mlp", "layers.0.mlp", "layers.1.mlp", "layers.1.mlp", "lm_head"]
    return StepProfile(stamps, ops, np.array([0, 0, 1, 0, 1, 1]))


def test_op_table_folds_layers_and_measures_from_the_stamps() -> None:
    table = op_table(synthetic_profile())
    assert table.steps == [1] and table.step_ns == pytest.approx(7000)
    rows = {r.op: r for r in table.rows}
    assert [r.op for r in table.rows] == ["embed", "mlp", "lm_head"]
    mlp = rows["mlp"]
    assert (mlp.ops_folded, mlp.tasks) == (2, 4)
    assert mlp.span_ns == pytest.approx((3000 - 1500) + (5000 - 3000))
    assert mlp.mean_task_ns == pytest.approx((1500 + 1000 + 1000 + 2000) / 4)
    assert mlp.mean_wait_ns == pytest.approx((500 + 1500 + 500 + 500) / 4)
    assert mlp.share == pytest.approx(3500 / 7000)
    # tail: last done after the median done (two tasks: their mean), per layer, summed
    assert mlp.tail_ns == pytest.approx((3000 - 2750) + (5000 - 4750))
    assert rows["embed"].tail_ns == 0.0
    # the task done last: layer 0's first (CTA 0, at 3000), layer 1's second (CTA 1, at 5000)
    assert (mlp.usually_last, mlp.usually_last_share) == (0, 0.5)
    assert (rows["embed"].usually_last, rows["embed"].usually_last_share) == (0, 1.0)
    # Spans: embed [0, 1000], layer 0 [1500, 3000], layer 1 [3000, 5000], lm_head [6000, 7000].
    assert table.gap_ns == pytest.approx(500 + 1000)
    assert table.to_dict()["ops"][1]["op"] == "mlp"


def test_op_table_floors_are_the_ops_bytes_at_the_ceiling() -> None:
    """Given the ops' bytes and the measured ceiling, a folded row's floor is its layers' bytes
    at that ceiling; an op whose bytes are unknown, or a table without a ceiling, has none."""
    prof = synthetic_profile()
    prof.op_bytes = {"layers.0.mlp": 3000.0, "layers.1.mlp": 1000.0, "lm_head": 500.0}
    rows = {r.op: r for r in op_table(prof, bytes_per_s=1e9).rows}
    assert rows["mlp"].floor_ns == pytest.approx(4000)  # 4000 B at 1 B/ns
    assert rows["lm_head"].floor_ns == pytest.approx(500)
    assert rows["embed"].floor_ns is None
    assert all(r.floor_ns is None for r in op_table(prof).rows)
    console = Console(record=True, width=160)
    print_op_table(op_table(prof, bytes_per_s=1e9), console)
    text = console.export_text()
    assert "floor µs" in text and "tail µs" in text and "last task" in text and "0 (50%)" in text


def test_op_bytes_sum_the_cost_models_task_bytes() -> None:
    """op_bytes: per op, its tasks' weight and other bytes as the schedule counts them."""
    program = schedule(load_spec("llama-tiny"), "h200", 1, 64)
    got = op_bytes(program)
    for op in program.graph.ops():
        assert got[op.name] == sum(t.weight_bytes + t.other_bytes for t in program.tasks
                                   if t.op == op.name)
    assert got["layers.0.qkv_proj"] > 0


def test_op_table_skips_incomplete_steps() -> None:
    prof = synthetic_profile()
    prof.stamps[1, 5] = 0  # lm_head never ran in step 1
    assert op_table(prof).steps == [0]
    prof.stamps[0, 5] = 0
    with pytest.raises(ValueError, match="no profiled step"):
        op_table(prof)


def test_fold_layer() -> None:
    assert fold_layer("layers.12.ffn.down_proj") == "ffn.down_proj"
    assert fold_layer("lm_head") == "lm_head"


def test_task_ops_and_ctas_of_a_real_schedule() -> None:
    program = schedule(load_spec("llama-tiny"), "h200", 1, 128)
    tasks, offsets, ids = encode.encode(program)
    counters = [c.name for c in program.counters]
    ops = task_ops(tasks, counters)
    assert ops == [t.op for t in program.tasks]
    ctas = task_ctas(offsets, ids, tasks.shape[0])
    assert (ctas >= 0).all()
    assert ctas.tolist() == [t.sm for t in program.tasks]


# -- outputs -------------------------------------------------------------------------------------
def is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 1000


def test_finish_writes_json_and_charts(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    points = [synthetic_point(Prediction(1.1, 0.9, 1536)), synthetic_point()]
    report = synthetic_report(points)
    console = Console(width=160, record=True)
    written = finish(report, synthetic_profile(), tmp_path, console)
    assert written == [tmp_path / "bench.json", tmp_path / "bench.png",
                       tmp_path / "timeline.png"]
    assert is_png(tmp_path / "bench.png") and is_png(tmp_path / "timeline.png")
    d = json.loads((tmp_path / "bench.json").read_text())
    assert d["profile"]["ops"][1]["op"] == "mlp" and d["profile"]["context"] == 1024
    text = console.export_text()
    for fact in ("tilertc", "hf-eager", "skipped: needs transformers", "measured roofline",
                 "tilertc predicted", "mlp", "tilertc: kernel"):
        assert fact in text


def test_time_baseline_reports_the_host_memory_it_took(monkeypatch) -> None:
    """A baseline that holds 64 MiB (67 MB) more of host memory while it runs says so in what
    ran; one that cannot run says why, as before."""
    from tilertc import bench
    from tilertc.baselines import BaselineResult, BaselineUnavailable

    def hoarder(spec, weights, prompt, gen, device) -> BaselineResult:
        held = torch.ones(64 << 20, dtype=torch.uint8)
        return BaselineResult.from_seconds("hoarder-eager", [1e-3 * (1 + held[0].item())] * gen)

    def unavailable(*args) -> BaselineResult:
        raise BaselineUnavailable("needs a CUDA device")

    monkeypatch.setattr(bench, "BASELINES", {"hoarder": hoarder, "none": unavailable})
    spec = load_spec("llama-tiny")
    timing, detail = time_baseline("hoarder", spec, {}, torch.zeros(4, dtype=torch.long), 8,
                                   "cpu", quiet_phase)
    assert timing.tokens == 8 and timing.ms_median == pytest.approx(2.0)
    if detail == "hoarder-eager":
        pytest.skip("this system does not let a process reset its peak RSS")
    name, grew = detail.split(", host peak RSS +")
    assert name == "hoarder-eager" and grew.endswith(" MB while it ran")
    assert 64 <= float(grew.split()[0]) < 100
    assert time_baseline("none", spec, {}, torch.zeros(4, dtype=torch.long), 8, "cpu",
                         quiet_phase) == ("needs a CUDA device", "")


def test_table_says_when_token_arrivals_came_in_bursts() -> None:
    nbytes = TokenBytes(weights=1000, kv=0, kv_context=64)
    point = make_point(64, 61, nbytes, 4e12,
                       {"tilertc": Timing.from_seconds([90e-6, 1e-6, 1e-6] * 20)})
    console = Console(width=160, record=True)
    print_point(point, console)
    assert "the mean, 0.0307 ms/token, is the sounder figure" in console.export_text()


def test_finish_without_profile_draws_no_timeline(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    written = finish(synthetic_report([synthetic_point()]), None, tmp_path, Console(width=160))
    assert written == [tmp_path / "bench.json", tmp_path / "bench.png"]
    assert json.loads((tmp_path / "bench.json").read_text())["profile"] is None


# -- arguments and the command line ----------------------------------------------------------------
def test_parse_points_systems_tuning() -> None:
    assert parse_points("1k/1k,8k/1k") == ((1024, 1024), (8192, 1024))
    assert parse_points("64/32") == ((64, 32),)
    with pytest.raises(ValueError, match="CONTEXT/GEN"):
        parse_points("1k")
    assert parse_systems("tilertc, hf-eager") == ("tilertc", "hf-eager")
    with pytest.raises(ValueError, match="include tilertc"):
        parse_systems("hf-eager")
    assert parse_tuning(("compute_warps=16",)) == (("compute_warps", 16),)
    with pytest.raises(ValueError, match="KNOB"):
        parse_tuning(("warps=16",))


def test_parse_backends() -> None:
    assert parse_backends("cuda, tilelang,cuda") == ("cuda", "tilelang")
    with pytest.raises(ValueError, match="unknown backend"):
        parse_backends("triton")


def test_kernels_compiled_and_prebuilt_are_named_apart(tmp_path: Path) -> None:
    config = BenchConfig("llama-tiny", ((64, 32),), tmp_path / "out")
    ((name, main_dir, _),) = resolve_artifacts(check_model(config), config, quiet_phase)
    assert name == "tilertc" and main_dir == tmp_path / "out" / "artifact"
    # the same model prebuilt elsewhere joins as a second kernel; another model is refused
    extra = BenchConfig("llama-tiny", ((64, 32),), tmp_path / "extra")
    ((_, extra_dir, _),) = resolve_artifacts(check_model(extra), extra, quiet_phase)
    both = BenchConfig("llama-tiny", ((64, 32),), tmp_path / "out", artifacts=(extra_dir,))
    kernels = resolve_artifacts(check_model(both), both, quiet_phase)
    assert [k.name for k in kernels] == ["tilertc", "tilertc-artifact"]
    twice = BenchConfig("llama-tiny", ((64, 32),), tmp_path / "out", artifacts=(extra_dir,) * 2)
    with pytest.raises(BenchError, match="'tilertc-artifact' is already timed"):
        resolve_artifacts(check_model(twice), twice, quiet_phase)
    other = BenchConfig("qwen3-tiny", ((64, 32),), tmp_path / "qwen")
    ((_, other_dir, _),) = resolve_artifacts(check_model(other), other, quiet_phase)
    mixed = BenchConfig("llama-tiny", ((64, 32),), tmp_path / "out", artifacts=(other_dir,))
    with pytest.raises(BenchError, match="holds qwen3-tiny, not the benchmarked model"):
        resolve_artifacts(check_model(mixed), mixed, quiet_phase)
    # an artifact directory as MODEL keeps its backend and weight format
    with pytest.raises(BenchError, match="add more with --artifact"):
        check_model(BenchConfig(str(main_dir), ((64, 32),), tmp_path, backends=("tilelang",)))
    with pytest.raises(BenchError, match="weight dtypes and config overrides apply to a"):
        check_model(BenchConfig(str(main_dir), ((64, 32),), tmp_path, weight_dtype="fp8"))
    with pytest.raises(BenchError, match="config overrides apply to a compile"):
        check_model(BenchConfig(str(main_dir), ((64, 32),), tmp_path,
                                overrides=(("num_hidden_layers", 1),)))


def test_fp8_weights_are_compiled_for_the_bench(tmp_path: Path) -> None:
    config = BenchConfig("llama-tiny", ((64, 32),), tmp_path, weight_dtype="fp8")
    spec = check_model(config)
    assert spec.weight_format.is_fp8
    ((_, _, m),) = resolve_artifacts(spec, config, quiet_phase)
    assert m["options"]["weight_dtype"] == "fp8" and m["kernel"]["constants"]["WEIGHT_FP8"] == 1


def test_config_overrides_make_a_variant_of_the_model() -> None:
    config = BenchConfig("llama-tiny", ((64, 32),), Path("unused"),
                         overrides=(("num_hidden_layers", 1), ("vocab_size", 100)))
    spec = check_model(config)
    assert (spec.num_layers, spec.vocab_size) == (1, 100)


def test_check_model_refuses_a_context_beyond_the_model() -> None:
    config = BenchConfig("llama-tiny", ((4096, 1024),), Path("unused"))
    with pytest.raises(BenchError, match="max_position_embeddings"):
        check_model(config)


def test_help_names_every_option() -> None:
    result = cli("bench", "--help")
    assert result.exit_code == 0
    for option in ("--context", "--gen", "--points", "--systems", "--tp", "--weights", "--out",
                   "--profile", "--device", "--tune", "--backend", "--artifact",
                   "--weight-dtype", "--temperature", "--top-k", "--top-p", "--sample-seed"):
        assert option in result.output


@pytest.mark.parametrize(("args", "message"), [
    (["--systems", "tilertc,vllm"], "unknown system(s) vllm"),
    (["--systems", "hf-eager"], "include tilertc"),
    (["--points", "1k"], "CONTEXT/GEN"),
    (["--gen", "1"], "--gen"),
    (["--tune", "page_kb=big"], "KNOB=INTEGER"),
    (["--backend", "cuda,triton"], "unknown backend(s) triton"),
    (["--top-k", "5"], "--top-k, --top-p and --sample-seed go with --temperature"),
    (["--temperature", "0.7", "--tp", "2"], "--temperature times sampling on one GPU, not with "
                                            "--tp 2"),
    (["--temperature", "0.7", "--per-layer"], "not with --per-layer"),
    (["--temperature", "-1"], "temperature must be 0 (greedy) or at least"),
    (["--temperature", "0.7", "--top-p", "1.5"], "top_p must be a number in (0, 1]"),
])
def test_argument_errors(args: list[str], message: str) -> None:
    result = cli("bench", "llama-tiny", *args)
    assert result.exit_code == 2
    assert message in result.output


def test_unknown_model_is_an_error_line() -> None:
    result = cli("bench", "no-such-model")
    assert result.exit_code == 1
    assert "Error: 'no-such-model' is neither a built-in model" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_without_a_gpu_bench_says_so(tmp_path: Path) -> None:
    result = cli("bench", "llama-tiny", "--context", "64", "--gen", "32", "--out",
                 str(tmp_path / "out"))
    assert result.exit_code == 1
    assert "needs a CUDA GPU" in result.output
    assert not (tmp_path / "out").exists()  # nothing compiled, nothing written


def test_cpu_device_is_refused(tmp_path: Path) -> None:
    result = cli("bench", "llama-tiny", "--device", "cpu", "--out", str(tmp_path))
    assert result.exit_code == 1
    assert "runs on a CUDA device, not 'cpu'" in result.output


# -- on the GPU ----------------------------------------------------------------------------------
@pytest.mark.gpu
def test_bench_end_to_end_on_gpu(tmp_path: Path) -> None:
    result = cli("bench", "llama-tiny", "--context", "64", "--gen", "32", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    d = json.loads((tmp_path / "bench.json").read_text())
    assert d["gate"]["passed"]
    (point,) = d["points"]
    systems = {s["name"]: s for s in point["systems"]}
    assert list(systems) == ["tilertc", "hf-eager", "hf-graph", "kernel-per-op"]
    for s in systems.values():
        assert s["status"] == "ok", s
        assert 0 < s["ms_per_token_median"] <= s["ms_per_token_p90"]
        assert s["roofline_pct"] > 0
    assert set(systems["tilertc"]["speedup_vs"]) == {"hf-eager", "hf-graph", "kernel-per-op"}
    assert 1e11 < d["ceiling"]["bytes_per_s"] < 1e13
    assert point["prediction"]["step_ms"] > 0
    if importlib.util.find_spec("matplotlib") is not None:
        assert is_png(tmp_path / "bench.png")


@pytest.mark.gpu
def test_bench_sets_the_dequantized_bf16_baselines_beside_an_fp8_kernel(tmp_path: Path) -> None:
    result = cli("bench", "llama-tiny", "--weight-dtype", "fp8", "--context", "64", "--gen", "32",
                 "--systems", "tilertc,hf-eager,kernel-per-op", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    d = json.loads((tmp_path / "bench.json").read_text())
    assert d["gate"]["passed"] and d["weights"].startswith("random fp8")
    (point,) = d["points"]
    systems = {s["name"]: s for s in point["systems"]}
    for name in ("hf-eager", "kernel-per-op"):
        assert systems[name]["status"] == "ok", systems[name]
        assert systems[name]["detail"].endswith("bf16, the FP8 weights dequantized")
    assert set(systems["tilertc"]["speedup_vs"]) == {"hf-eager", "kernel-per-op"}


@pytest.mark.gpu
def test_bench_times_every_kernel_after_its_gate(tmp_path: Path) -> None:
    prebuilt = tmp_path / "prebuilt"
    assert cli("compile", "llama-tiny", "-o", str(prebuilt), "--max-seq-len", "128").exit_code == 0
    result = cli("bench", "llama-tiny", "--context", "64", "--gen", "32", "--systems", "tilertc",
                 "--artifact", str(prebuilt), "--out", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    d = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert set(d["kernels"]) == {"tilertc", "tilertc-prebuilt"}
    assert all(k["gate"]["passed"] for k in d["kernels"].values())
    (point,) = d["points"]
    systems = {s["name"]: s for s in point["systems"]}
    assert list(systems) == ["tilertc", "tilertc-prebuilt"]
    assert systems["tilertc"]["speedup_vs"]["tilertc-prebuilt"] > 0


@pytest.mark.gpu
def test_bench_times_sampled_decoding_beside_greedy(tmp_path: Path) -> None:
    """--temperature adds a row of the same kernel sampling in the kernel, named for it and
    saying its settings, compared with the greedy row."""
    result = cli("bench", "llama-tiny", "--context", "64", "--gen", "32", "--systems", "tilertc",
                 "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--out",
                 str(tmp_path))
    assert result.exit_code == 0, result.output
    (point,) = json.loads((tmp_path / "bench.json").read_text())["points"]
    systems = {s["name"]: s for s in point["systems"]}
    assert list(systems) == ["tilertc", "tilertc sampled"]
    sampled = systems["tilertc sampled"]
    assert sampled["status"] == "ok" and sampled["ms_per_token_median"] > 0
    assert sampled["detail"].endswith("temperature 0.8, top-k 20, top-p 0.9, seed 0")
    assert sampled["speedup_vs"]["tilertc"] > 0


@pytest.mark.gpu
def test_bench_profile_on_gpu(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    result = cli("bench", "llama-tiny", "--context", "64", "--gen", "32", "--systems",
                 "tilertc", "--profile", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert is_png(tmp_path / "timeline.png")
    prof = json.loads((tmp_path / "bench.json").read_text())["profile"]
    ops = {r["op"] for r in prof["ops"]}
    assert {"embed", "qkv_proj", "attention", "o_proj", "lm_head"} <= ops
    assert 0 < prof["step_ns"] and all(r["span_ns"] >= 0 for r in prof["ops"])


# -- the GPU-side steps, with the interpreter standing in for the kernel -------------------------
class InterpreterEngine:
    """What `tilertc.bench` uses of an `Engine`, computed by the interpreter on the CPU; with
    `corrupt`, the logits of one step are off, as a broken kernel's would be."""

    def __init__(self, name: str, max_seq_len: int = 128, corrupt_step: int | None = None,
                 misroute_step: int | None = None):
        from tilertc import build_graph
        from tilertc.ir.interpreter import Interpreter
        from tilertc.ir.weights import random_weights

        self.spec = load_spec(name)
        self.graph = build_graph(self.spec, max_seq_len)
        self.weights = random_weights(self.graph, seed=1)
        self.device = torch.device("cpu")
        self.interp = Interpreter(self.graph, self.weights, "cpu")
        self.position, self.steps, self.corrupt_step = 0, 0, corrupt_step
        self.misroute_step, self.env = misroute_step, {}
        self.prefills: list[int] = []
        self.sampled_with: list[dict] = []  # each generate's sampling settings

    def reference(self, cache_dtype: torch.dtype | None = None):
        ref = self.interp.fresh(cache_dtype)
        for name, cache in ref.state.items():
            cache.copy_(self.interp.state[name])
        return ref

    def routing(self) -> dict[int, tuple[list[int], list[float]]]:
        """The last step's routing; with `misroute_step`, that step's first choice replaced by
        the expert its router scored lowest."""
        out = {}
        for op in self.graph.ops():
            if op.opcode == "moe_router":
                ids = self.env[op.outputs[0]][0].tolist()
                if self.steps - 1 == self.misroute_step:
                    scores = self.env[op.inputs[0]][0] @ self.weights[
                        self.graph.tensors[op.inputs[1]].hf_name].float().T
                    ids[0] = int(scores.argmin())
                out[op.layer] = (ids, self.env[op.outputs[1]][0].tolist())
        return out

    def prefill(self, ids: torch.Tensor) -> None:
        self.interp.run(ids, torch.arange(self.position, self.position + ids.numel()))
        self.position += ids.numel()
        self.prefills.append(ids.numel())

    def step(self, token: int) -> tuple[int, torch.Tensor]:
        self.env = self.interp.run(torch.tensor([token]), torch.tensor([self.position]))
        logits = self.env["logits"][0]
        if self.steps == self.corrupt_step:
            logits = logits + logits.abs().max() * torch.randn(logits.shape)
        self.position += 1
        self.steps += 1
        return int(logits.argmax()), logits

    def generate(self, ids, max_new_tokens: int, **sampling):
        self.sampled_with.append(sampling)
        token = int(torch.as_tensor(ids).reshape(-1)[-1])
        for _ in range(max_new_tokens):
            token, _ = self.step(token)
            yield token


def test_gate_glue_passes_a_kernel_that_computes_the_model() -> None:
    engine = InterpreterEngine("qwen3-tiny")
    report = run_gate(engine, engine.weights, "cpu", seed=0)
    assert report.passed, report.problems
    assert report.steps == GATE_STEPS and report.baseline == "kernel-per-op-eager"
    assert report.baseline_tokens_compared > 0


def test_gate_glue_refuses_a_kernel_with_wrong_logits() -> None:
    engine = InterpreterEngine("llama-tiny", corrupt_step=5)
    report = run_gate(engine, engine.weights, "cpu", seed=0)
    assert any(p.startswith("step 5: the kernel's logits differ") for p in report.problems)


def test_gate_glue_checks_moe_routing() -> None:
    """An MoE model: the gate compares the kernel's routing with the interpreter's at every
    step; one expert swapped for the router's lowest-scored one fails it."""
    engine = InterpreterEngine("qwen3-moe-tiny")
    report = run_gate(engine, engine.weights, "cpu", seed=0)
    assert report.passed, report.problems
    assert report.tied_steps == [] and report.baseline is None  # no kernel-per-op MoE engine
    engine = InterpreterEngine("qwen3-moe-tiny", misroute_step=2)
    problems = run_gate(engine, engine.weights, "cpu", seed=0).problems
    assert problems and all(p.startswith("step 2, layer ") and "outside a tie" in p
                            for p in problems)


def test_time_kernel_prefills_in_chunks_and_times_each_token(monkeypatch) -> None:
    import tilertc.bench as bench

    monkeypatch.setattr(bench, "PREFILL_CHUNK", 16)
    engine = InterpreterEngine("llama-tiny")
    prompt = torch.arange(40) % engine.spec.vocab_size
    timing = Timing.from_seconds(bench.time_kernel(engine, prompt, 6, bench.quiet_phase))
    assert engine.prefills == [16, 16, 7] and engine.position == 39
    assert timing.tokens == 5 and 0 < timing.ms_median <= timing.ms_p90


def test_time_kernel_samples_as_asked(monkeypatch) -> None:
    """The warm-up and the timed launch both choose tokens with the settings given (greedy
    by default), as `Engine.generate` takes them."""
    import tilertc.bench as bench
    from tilertc.ir.sampling import SamplingParams

    engine = InterpreterEngine("llama-tiny")
    prompt = torch.arange(8) % engine.spec.vocab_size
    bench.time_kernel(engine, prompt, 4, bench.quiet_phase)
    bench.time_kernel(engine, prompt, 4, bench.quiet_phase,
                      sampling=SamplingParams(0.7, 40, 0.9, 3))
    greedy = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0}
    sampled = {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "seed": 3}
    assert engine.sampled_with == [greedy, greedy, sampled, sampled]
    assert bench.describe(SamplingParams(0.7, 0, 0.9, 3)) == (
        "temperature 0.7, top-k off, top-p 0.9, seed 3")


def test_rounds_take_turns_in_alternating_order() -> None:
    from tilertc.bench import round_order

    names = ["tilertc", "tilertc-a", "tilertc-b"]
    assert [round_order(names, r) for r in range(3)] == [names, names[::-1], names]



def flat_logits(step: int, vocab: int) -> torch.Tensor:
    """A near tie between tokens 0 and 1, clearly won by token 1 at every sixth step only, as
    random weights over a large vocabulary give."""
    logits = torch.zeros(1, vocab)
    logits[0, :2] = 1.0
    logits[0, 1] += float(step % 6 == 0)
    return logits


class FlatLogitsEngine(InterpreterEngine):
    """Kernel and reference agree, and only every sixth step has a clear margin."""

    def step(self, token: int) -> tuple[int, torch.Tensor]:
        logits = flat_logits(self.steps, self.spec.vocab_size)[0]
        self.position += 1
        self.steps += 1
        return int(logits.argmax()), logits

    def reference(self, _cache_dtype: torch.dtype | None = None):
        engine = self

        class Reference:
            steps = 0

            def run(self, tokens: torch.Tensor, _positions: torch.Tensor):
                self.steps += 1
                return {"logits": flat_logits(self.steps - 1, engine.spec.vocab_size)}

        return Reference()


def test_gate_decodes_on_until_enough_steps_have_a_clear_margin() -> None:
    """Steps 0, 6 and 12 of the first GATE_STEPS are clear: the gate decodes on to step 18, the
    fourth clear one, and judges all 19 steps."""
    engine = FlatLogitsEngine("llama-tiny")
    report = run_gate(engine, engine.weights, "cpu", seed=0)
    assert report.clear_steps == MIN_CLEAR_STEPS and report.steps == 19
