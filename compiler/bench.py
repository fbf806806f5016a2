"""`tilertc bench`: the persistent kernel against the conventional decoders, on one GPU, in one
process, with the same weights and the same prompt, after a correctness gate.

Order of a run: resolve the artifacts (compile a model with each backend asked for, or load
artifact directories), load the weights once (random bf16, or a checkpoint) and share them with
every system; the bandwidth ceiling; per kernel, the gate (`tilertc.bench_gate`) on a short run,
then its token loop at every point (context, gen), and for the first kernel optionally a
profiled run; then per point each baseline of `tilertc.baselines`.
The figures are computed in `tilertc.bench_report`, and the pictures drawn in
`tilertc.bench_charts`. docs/performance.md, "How to benchmark", says what is measured.
"""

from __future__ import annotations

import gc
import json
import re
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple

import torch
from rich.console import Console

from tilertc import baselines
from tilertc.artifact import check_capacity, model_spec, read_manifest
from tilertc.bench_gate import (
    MIN_CLEAR_STEPS,
    GateFailure,
    GateReport,
    check_decode,
    clear_margins,
    depth_tolerance,
)
from tilertc.bench_report import (
    BenchReport,
    Prediction,
    Timing,
    arrival_intervals,
    make_point,
    print_point,
    token_bytes,
)
from tilertc.choice_check import CHOOSING_OPS, check_choices
from tilertc.compile_report import StageDisplay
from tilertc.driver import TUNING_FLAGS, TUNING_KNOBS, schedule_tuning
from tilertc.engine import device_bytes
from tilertc.inspect import human_bytes
from tilertc.ir.sampling import SamplingParams
from tilertc.model_specs import load_spec
from tilertc.model_specs.hf import with_weight_dtype
from tilertc.model_specs.spec import ModelSpec
from tilertc.passes.program import Program
from tilertc.profile import StepProfile, op_table, print_op_table, profile_engine

SYSTEMS = ("tilertc", "hf-eager", "hf-graph", "kernel-per-op")
BASELINES: dict[str, Callable[..., baselines.BaselineResult]] = {
    "hf-eager": baselines.hf_eager,
    "hf-graph": baselines.hf_cuda_graph,
    "kernel-per-op": baselines.kernel_per_op,
}
# The gate decodes GATE_STEPS steps, and more (up to GATE_MAX_STEPS) until MIN_CLEAR_STEPS of
# them have a clear top-2 margin: random weights over a large vocabulary (Qwen3's 152k) give
# flat logits, where fewer steps than that are clear.
GATE_PROMPT, GATE_STEPS, GATE_MAX_STEPS = 32, 16, 64
WARMUP_TOKENS = 8
GREEDY = SamplingParams()
SAMPLED = " sampled"  # after a kernel's name: its row timed with --temperature's sampling
PREFILL_CHUNK = 256  # tokens: a chunk's attention scores and activations stay small
PROFILE_STEPS = 8

Phase = Callable[[str], AbstractContextManager[None]]


class BenchError(RuntimeError):
    """The benchmark cannot run as asked (no GPU, an artifact too small for the context)."""


@dataclass(frozen=True)
class BenchConfig:
    model: str  # built-in name, config.json, a directory with one, or an artifact directory
    points: tuple[tuple[int, int], ...]  # (context, gen)
    out: Path
    systems: tuple[str, ...] = SYSTEMS
    weights: str | None = None  # checkpoint; None: random bf16 drawn with `seed`
    seed: int = 0
    tp: int = 1
    device: str = "cuda:0"
    profile: bool = False
    tuning: tuple[tuple[str, int], ...] = ()  # (knob, value) for the compile, to try schedules
    weight_dtype: str | None = None  # "fp8" / "bf16" for the compile; None: the config's own
    backends: tuple[str, ...] = ("cuda",)  # one kernel per backend; the first is "tilertc"
    artifacts: tuple[Path, ...] = ()  # prebuilt kernels of the same model, timed as well
    rounds: int = 1  # times each kernel is timed, in turns (round_order), all loaded at once
    # Config keys replaced before the spec is read (`load_spec`'s overrides): a variant of the
    # model, such as the few-layer ones `tilertc bench --per-layer` times.
    overrides: tuple[tuple[str, Any], ...] = ()
    # Not greedy: every tilertc kernel is timed a second time sampling with these settings in
    # the kernel (SAMPLED rows); the gate and the baselines stay greedy.
    sampling: SamplingParams | None = None
    command: str = ""


def parse_count(text: str) -> int:
    """'1024', '1k' (1024) or '8K' (8192)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kK]?)\s*", text)
    if not m:
        raise ValueError(f"expected a token count such as 1024 or 1k, got {text!r}")
    return int(m[1]) * (1024 if m[2] else 1)


def parse_points(text: str) -> tuple[tuple[int, int], ...]:
    """'1k/1k,8k/1k' -> ((1024, 1024), (8192, 1024)): context/gen pairs."""
    points = []
    for part in text.split(","):
        context, sep, gen = part.partition("/")
        if not sep:
            raise ValueError(f"expected CONTEXT/GEN such as 1k/1k, got {part!r}")
        points.append((parse_count(context), parse_count(gen)))
    return tuple(points)


def parse_systems(text: str) -> tuple[str, ...]:
    """A comma-separated subset of SYSTEMS, which must include tilertc (the gate needs it)."""
    names = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown system(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(SYSTEMS)}")
    if "tilertc" not in names:
        raise ValueError("the systems must include tilertc: it is what is benchmarked")
    return names


def parse_backends(text: str) -> tuple[str, ...]:
    """A comma-separated list of code generators, e.g. 'cuda,tilelang'."""
    from tilertc.driver import BACKENDS

    names = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    unknown = [n for n in names if n not in BACKENDS]
    if unknown or not names:
        raise ValueError(f"unknown backend(s) {', '.join(unknown) or '(none)'}; choose from "
                         f"{', '.join(BACKENDS)}")
    return names


def parse_tuning(pairs: tuple[str, ...]) -> tuple[tuple[str, int], ...]:
    """'compute_warps=16' and the like: schedule knobs to compile with instead of the passes'
    choice, to compare schedules with the same measurement."""
    out = []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in TUNING_KNOBS or not value.strip().isdigit():
            raise ValueError(f"expected KNOB=INTEGER with KNOB one of {', '.join(TUNING_KNOBS)}, "
                             f"got {pair!r}")
        if key in TUNING_FLAGS:
            if value.strip() not in ("0", "1"):
                raise ValueError(f"{key} is a flag: expected {key}=0 or {key}=1, got {pair!r}")
            out.append((key, value.strip() == "1"))
        else:
            out.append((key, int(value)))
    return tuple(out)


def describe(sampling: SamplingParams) -> str:
    """The sampling settings as the bench's rows say them."""
    return (f"temperature {sampling.temperature:g}, top-k {sampling.top_k or 'off'}, "
            f"top-p {sampling.top_p:g}, seed {sampling.seed}")


def check_points(points: tuple[tuple[int, int], ...]) -> None:
    for context, gen in points:
        if context < 1 or gen < 2:
            raise ValueError(f"point {context}/{gen}: the context needs at least 1 token and "
                             "at least 2 tokens must be decoded (a time is between two)")


def capacity_for(points: tuple[tuple[int, int], ...]) -> int:
    """The KV capacity every point (and the gate's short run) fits in."""
    return max(GATE_PROMPT + GATE_MAX_STEPS, *(context + gen for context, gen in points))


@contextmanager
def quiet_phase(_description: str) -> Iterator[None]:
    """A phase that shows nothing: for callers of `run_bench` without a terminal."""
    yield


def rescheduled(spec: ModelSpec, m: dict[str, Any], kv_context: int) -> Program:
    """The artifact's schedule (same target, tp and tuning knobs) made for a point's mean
    context, so that the cost model counts the KV bytes actually read. FP8 tiles or rows as
    the artifact has them: the compile's choice between the two (make_program) was made at
    its max_seq_len and could go the other way at this context."""
    from tilertc import schedule

    opts = m["options"]
    tuning = schedule_tuning(opts)
    tuning.setdefault("fp8_mma", any(e.get("tiles") for e in m["weights"]["layout"]))
    return schedule(spec, m["target"]["name"], opts["tp"], kv_context, tuning)


def prediction(program: Program, kv_context: int) -> Prediction:
    """The cost model's time per token for the artifact's schedule at the point's context
    (`rescheduled`)."""
    from tilertc.passes.cost import roofline_ns, step_ns

    return Prediction(step_ns(program) / 1e6, roofline_ns(program) / 1e6, kv_context)


def op_bytes(program: Program) -> dict[str, float]:
    """Per fused op, the bytes its tasks read as the cost model counts them (weights, the KV
    cache at the schedule's context; routed weights at their expected share)."""
    out: dict[str, float] = {}
    for t in program.tasks:
        out[t.op] = out.get(t.op, 0.0) + t.weight_bytes + t.other_bytes
    return out


def check_model(config: BenchConfig) -> Path | ModelSpec:
    """What MODEL_OR_DIR names, checked before any GPU work: an artifact directory with room
    for every point, or a model spec (SpecError) to compile with that room."""
    capacity = capacity_for(config.points)
    src = Path(config.model)
    if (src / "manifest.json").is_file():
        m = read_manifest(src)
        if m["max_seq_len"] < capacity:
            raise BenchError(f"{src} holds {m['max_seq_len']} KV positions; the points need "
                             f"{capacity}: recompile with --max-seq-len {capacity}")
        if m["options"]["tp"] != config.tp:
            raise BenchError(f"{src} was compiled for tp={m['options']['tp']}, not {config.tp}")
        if (config.tuning or config.backends != ("cuda",) or config.weight_dtype
                or config.overrides):
            raise BenchError("tuning knobs, backends, weight dtypes and config overrides apply "
                             "to a compile; an artifact directory keeps what it was built with "
                             "(add more with --artifact)")
        return src
    spec = with_weight_dtype(load_spec(config.model, dict(config.overrides)), config.weight_dtype)
    if capacity > spec.max_position_embeddings:
        raise BenchError(f"the points need {capacity} positions, more than {spec.name}'s "
                         f"max_position_embeddings {spec.max_position_embeddings}")
    return spec


class Kernel(NamedTuple):
    """A kernel to time: its system name, artifact directory and manifest."""

    name: str
    path: Path
    manifest: dict[str, Any]


def resolve_artifacts(model: Path | ModelSpec, config: BenchConfig, phase: Phase) -> list[Kernel]:
    """The kernels to time: the artifact given, or the spec compiled with each backend
    (OUT/artifact, then OUT/artifact-BACKEND); then the --artifact directories, which must hold
    the same model with room for every point, each named tilertc-BACKEND where its backend is
    not yet timed, else tilertc-DIRECTORY."""
    from tilertc.driver import CompileOptions, compile

    capacity = capacity_for(config.points)
    paths = [("tilertc", model)] if isinstance(model, Path) else []
    for i, backend in enumerate(() if paths else config.backends):
        options = CompileOptions(backend=backend, tp=config.tp, max_seq_len=capacity,
                                 weight_dtype=config.weight_dtype, **dict(config.tuning))
        out = config.out / ("artifact" if i == 0 else f"artifact-{backend}")
        with phase(f"compiling {model.name} with {backend} (KV capacity {capacity})"):
            paths.append(("tilertc" if i == 0 else f"tilertc-{backend}",
                          compile(model, out, options)))
    kernels = [Kernel(name, path, read_manifest(path)) for name, path in paths]
    spec_hash = kernels[0].manifest["model"]["spec_hash"]
    for extra in config.artifacts:
        m = read_manifest(extra)
        if m["model"]["spec_hash"] != spec_hash:
            raise BenchError(f"{extra} holds {m['model']['name']}, not the benchmarked model")
        check_capacity(0, capacity - 1, 1, m["max_seq_len"])
        # another backend's build is named by its backend, a variant of one already timed by
        # its directory
        backend = m["options"]["backend"]
        timed = {k.manifest["options"]["backend"] for k in kernels}
        name = f"tilertc-{backend}" if backend not in timed else f"tilertc-{extra.name}"
        if name in {k.name for k in kernels}:
            raise BenchError(f"{extra}: a kernel named {name!r} is already timed; give the "
                             f"artifact directories distinct names")
        kernels.append(Kernel(name, extra, m))
    return kernels


def require_gpu(device: str) -> None:
    if torch.device(device).type != "cuda":
        raise BenchError(f"tilertc bench runs on a CUDA device, not {device!r}")
    if not torch.cuda.is_available():
        raise BenchError("tilertc bench needs a CUDA GPU, and none is available here "
                         "(torch.cuda.is_available() is false)")


def check_room(name: str, m: dict[str, Any], free: int | None, held: int, rounds: int) -> None:
    """Refuse, before loading it, a kernel whose packed weights and arenas would not fit in the
    `free` bytes left beside the model's weights and the `held` kernels already loaded (with
    --rounds above 1 every kernel stays loaded): a clear error rather than torch's out of
    memory partway through the run."""
    need = device_bytes(m)
    if free is None or need <= free:
        return
    why = (f"; --rounds {rounds} keeps every kernel loaded and {held} already are: time fewer "
           "kernels at once (--artifact) or use --rounds 1") if held else ""
    raise BenchError(f"{name}: the kernel needs ~{human_bytes(need)} of GPU memory (packed "
                     f"weights, arenas), {human_bytes(free)} is free beside the model's "
                     f"weights{why}")


def free_gpu() -> None:
    """Drop what the last system left, so that each runs on an otherwise idle GPU."""
    gc.collect()
    torch.cuda.empty_cache()


def run_gate(engine: Any, weights: dict[str, torch.Tensor], device: str, seed: int) -> GateReport:
    """The kernel, the interpreter and the kernel-per-op baseline over one short greedy run.
    With MoE or a DSA indexer the interpreter keeps its caches in bf16 as the kernel does
    (their discrete choices would otherwise see the cache's rounding), and a step at which
    the kernel routed or selected otherwise within a tie (`choice_check`) is not compared; one
    that chose otherwise outside a tie fails the gate."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, engine.spec.vocab_size, (GATE_PROMPT,), generator=gen)
    engine.position = 0
    engine.prefill(prompt[:-1])
    choosers = any(op.opcode in CHOOSING_OPS for op in engine.graph.ops())
    ref = engine.reference(torch.bfloat16 if choosers else None)
    token, tokens, got, want, tied, wrong = int(prompt[-1]), [], [], [], [], []
    for i in range(GATE_MAX_STEPS):
        clear = [c and not t for c, t in zip(clear_margins(torch.stack(want)), tied,
                                              strict=True)] if want else []
        if i >= GATE_STEPS and sum(clear) >= MIN_CLEAR_STEPS:
            break
        nxt, logits = engine.step(token)
        env = ref.run(torch.tensor([token]), torch.tensor([GATE_PROMPT - 1 + i]))
        choices = check_choices(engine, env) if choosers else []
        wrong += [f"step {i}, {c}" for c in choices if not c.ok]
        tied.append(not all(c.same for c in choices))
        want.append(env["logits"][0].float().cpu())
        got.append(logits.float().cpu())
        tokens.append(nxt)
        token = nxt
    del ref
    free_gpu()
    try:
        kpo = baselines.kernel_per_op(engine.spec, weights, prompt.tolist(), len(tokens) - 1,
                                      device, warmup=0, keep_logits=True)
        baseline_tokens, baseline_logits, name = list(kpo.tokens), torch.stack(kpo.logits), kpo.name
    except baselines.BaselineUnavailable:
        baseline_tokens, baseline_logits, name = None, None, None
    free_gpu()
    report = check_decode(torch.stack(got), torch.stack(want), tokens, baseline_tokens, name,
                          depth_tolerance(engine.spec.num_layers), tied=tied,
                          baseline_logits=baseline_logits)
    report.problems += [f"{m}: chosen otherwise outside a tie" for m in wrong]
    return report


def time_kernel(engine: Any, prompt: torch.Tensor, gen: int, phase: Phase,
                name: str = "tilertc", sampling: SamplingParams = GREEDY) -> list[float]:
    """Prefill (the interpreter, untimed), warm up, then time `gen` tokens of one launch by
    the host clock at which each token arrives through the host-mapped ring: the seconds
    between consecutive tokens, the launch's first interval left out. Tokens chosen as
    `sampling` says (in the kernel)."""
    engine.position = 0
    with phase(f"{name}: prefill of {prompt.numel() - 1} tokens (interpreter, not timed)"):
        # In chunks: the interpreter's attention holds [tokens, heads, context] scores.
        for chunk in prompt[:-1].split(PREFILL_CHUNK) if prompt.numel() > 1 else ():
            engine.prefill(chunk)
    start_pos, last = engine.position, prompt[-1:]
    with phase(f"{name}: {gen} tokens in one launch"):
        choose = asdict(sampling)  # Engine.generate's keywords are its fields
        list(engine.generate(last, min(WARMUP_TOKENS, gen), **choose))  # returns once it ended
        engine.position = start_pos
        arrivals = []
        start = time.perf_counter()
        for _ in engine.generate(last, gen, **choose):
            arrivals.append(time.perf_counter())
    engine.position = start_pos
    if len(arrivals) != gen:
        raise RuntimeError(f"the kernel stopped after {len(arrivals)} of {gen} tokens")
    # The first interval carries the launch; the others are the steady token loop.
    return arrival_intervals(start, arrivals)[1:]


def round_order(names: Sequence[str], r: int) -> list[str]:
    """The kernels' timing order in round r of `--rounds`: as given, then reversed, and so on,
    so that none is always timed first (on a GPU that has warmed up the least)."""
    return list(names) if r % 2 == 0 else list(reversed(names))


def time_baseline(name: str, spec: ModelSpec, weights: dict[str, torch.Tensor],
                  prompt: torch.Tensor, gen: int, device: str,
                  phase: Phase) -> tuple[Timing | str, str]:
    """(timing, what ran) of one baseline, or (why it was skipped, ""). What ran says how far
    the host's memory rose while it ran (the bench holds the weights there already: a
    baseline's own copy of them would show here)."""
    with phase(f"{name}: {gen} tokens after a {prompt.numel()}-token prefill"):
        try:
            with baselines.HostPeak() as host:
                r = BASELINES[name](spec, weights, prompt.tolist(), gen, device)
        except baselines.BaselineUnavailable as e:
            return str(e), ""
        finally:
            free_gpu()
    detail = r.name if host.growth is None else \
        f"{r.name}, host peak RSS +{human_bytes(host.growth)} while it ran"
    return Timing(r.ms_per_token_median, r.ms_per_token_p90, gen), detail


def run_bench(config: BenchConfig,
              phase: Phase = quiet_phase) -> tuple[BenchReport, StepProfile | None]:
    """Run the benchmark on the GPU; returns the report and the profile (or None). Raises
    GateFailure, without timing anything, when the gate finds a mismatch."""
    from tilertc.engine import Engine
    from tilertc.ir.build import build_graph
    from tilertc.ir.weights import load_state_dict, random_weights

    model = check_model(config)
    require_gpu(config.device)
    if config.profile and config.tp > 1:
        raise ValueError(f"--profile runs one GPU; profile the model at --tp 1, not --tp "
                         f"{config.tp}")
    config.out.mkdir(parents=True, exist_ok=True)
    kernels = resolve_artifacts(model, config, phase)
    m = kernels[0].manifest
    spec = model_spec(m)
    for context, gen in config.points:
        check_capacity(0, context, gen, m["max_seq_len"])
    with phase("loading the weights"):
        weights = (load_state_dict(config.weights) if config.weights else
                   random_weights(build_graph(spec, m["max_seq_len"]), seed=config.seed,
                                  device=config.device))
    with phase("measuring the bandwidth ceiling"):
        ceiling = baselines.bandwidth_ceiling(1 << 30, config.device)
    prompts = [torch.randint(0, spec.vocab_size, (context,),
                             generator=torch.Generator().manual_seed(config.seed + context))
               for context, _ in config.points]
    results: list[dict[str, Timing | str]] = [{} for _ in config.points]
    details: dict[str, str] = {}
    records: dict[str, dict[str, Any]] = {}
    profile = None
    intervals: list[dict[str, list[float]]] = [{} for _ in config.points]

    def time_points(engine: Any, name: str) -> None:
        nonlocal profile
        for i, ((_, gen), prompt) in enumerate(zip(config.points, prompts, strict=True)):
            intervals[i].setdefault(name, []).extend(time_kernel(engine, prompt, gen, phase, name))
            if config.sampling:
                intervals[i].setdefault(name + SAMPLED, []).extend(time_kernel(
                    engine, prompt, gen, phase, name + SAMPLED, config.sampling))
            if config.profile and profile is None:
                with phase(f"{name}: {min(PROFILE_STEPS, gen)} profiled steps"):
                    profile = profile_engine(engine, int(prompt[-1]), min(PROFILE_STEPS, gen))

    # With one round, one engine at a time: each has the GPU to itself. With more, all stay
    # loaded and take turns (round_order).
    engines: dict[str, Any] = {}
    for name, artifact, km in kernels:
        if config.tp == 1:
            check_room(name, km, baselines.free_bytes(config.device), len(engines), config.rounds)
        with phase(f"{name}: loading the kernel ({km['options']['backend']} backend)"):
            engine = Engine.load(artifact, weights=weights, device=config.device)
        with phase(f"{name}: correctness gate, kernel vs interpreter vs kernel-per-op"):
            gate = run_gate(engine, weights, config.device, config.seed)
        if not gate.passed:
            raise GateFailure(gate, name)
        records[name] = {"artifact": {"path": str(artifact), "hash": km["hash"],
                                      "max_seq_len": km["max_seq_len"],
                                      "options": km["options"]}, "gate": gate.to_dict()}
        details[name] = f"persistent kernel ({km['options']['backend']}), artifact {km['hash']}"
        if config.sampling:
            details[name + SAMPLED] = f"{name} sampling in the kernel: {describe(config.sampling)}"
        device_name = torch.cuda.get_device_name(engine.device)
        if config.rounds > 1:
            engines[name] = engine
        else:
            time_points(engine, name)
        del engine
        free_gpu()
    if engines:  # --rounds > 1
        for r in range(config.rounds):
            for name in round_order(list(engines), r):
                time_points(engines[name], name)
        engines.clear()
        free_gpu()
    for i, times in enumerate(intervals):
        results[i].update({name: Timing.from_seconds(t) for name, t in times.items()})
    # Beside an FP8 kernel the baselines run the bf16 model its weights dequantize to (once,
    # on the host): what people run today, on the numbers the kernel computes with.
    base_spec, base_weights, base_note = spec, weights, ""
    if spec.weight_format.is_fp8 and config.tp == 1 and set(config.systems) - {"tilertc"}:
        with phase("the baselines' bf16 model: the FP8 weights dequantized"):
            base_spec, base_weights = baselines.dequantized_model(spec, weights)
        base_note = "; bf16, the FP8 weights dequantized"
    points = []
    for i, ((context, gen), prompt) in enumerate(zip(config.points, prompts, strict=True)):
        for name in config.systems:
            if name != "tilertc" and config.tp > 1:  # the baselines run on one GPU
                results[i][name], details[name] = (f"skipped: one GPU, not comparable with "
                                                   f"--tp {config.tp}"), ""
            elif name != "tilertc":
                results[i][name], details[name] = time_baseline(
                    name, base_spec, base_weights, prompt, gen, config.device, phase)
                if details[name]:
                    details[name] += base_note
        nbytes = token_bytes(spec, context, gen)
        program = rescheduled(spec, m, nbytes.kv_context)
        points.append(make_point(context, gen, nbytes, ceiling.bytes_per_s, results[i], details,
                                 prediction(program, nbytes.kv_context)))
        if profile is not None and i == 0:  # the profile ran at the first point
            profile.op_bytes = op_bytes(program)
    report = BenchReport(
        model={"name": spec.name, "spec_hash": spec.content_hash()},
        artifact=records["tilertc"]["artifact"],
        device={"name": device_name, "torch": torch.__version__, "cuda": torch.version.cuda},
        weights=config.weights or (f"random {'fp8' if spec.weight_format.is_fp8 else 'bf16'} "
                                   f"(seed {config.seed})"),
        ceiling={"bytes_per_s": ceiling.bytes_per_s, "method": ceiling.name},
        gate=records["tilertc"]["gate"], points=points, command=config.command,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"), kernels=records)
    return report, profile


def finish(report: BenchReport, profile: StepProfile | None, out: Path,
           console: Console) -> list[Path]:
    """Show the tables, write bench.json and draw the charts; returns the files written. A
    missing matplotlib costs the pictures, not the numbers."""
    from tilertc.bench_charts import plot_bench, plot_timeline

    for point in report.points:
        print_point(point, console)
    table = None
    if profile is not None:
        table = op_table(profile, bytes_per_s=report.ceiling["bytes_per_s"])
        report.profile = {"context": report.points[0].context, **table.to_dict()}
        print_op_table(table, console)
    path = out / "bench.json"
    path.write_text(json.dumps(report.to_dict(), indent=1) + "\n")
    written = [path]
    title = f"{report.model['name']} on {report.device['name']}, batch 1"
    try:
        written.append(plot_bench(report.points, title, out / "bench.png"))
        if profile is not None and table is not None:
            step = table.steps[-1]
            written.append(plot_timeline(profile, step, f"{title}: step {step}, context "
                                         f"{report.points[0].context}", out / "timeline.png"))
    except RuntimeError as e:
        console.print(f"[yellow]no charts: {e}")
    return written


@contextmanager
def stage_phases(console: Console) -> Iterator[Phase]:
    """Phases shown as `tilertc compile` shows its stages: a spinner and a clock for the one
    running, the duration of each one done; an error between phases (a kernel refused before
    it loads) marks none of them failed."""
    with StageDisplay(console) as stages:

        @contextmanager
        def phase(description: str) -> Iterator[None]:
            stages(description)
            yield
            stages.finish()

        yield phase
