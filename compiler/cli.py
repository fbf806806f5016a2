"""The `tilertc` command line."""

import json
import time
from collections.abc import Callable

import click
from rich.console import Console

from tilertc.driver import BACKENDS
from tilertc.ir.sampling import SamplingParams
from tilertc.ir.target import TARGETS, get_target
from tilertc.model_specs import ModelSpec, SpecError, load_spec
from tilertc.model_specs.hf import WEIGHT_DTYPES, with_weight_dtype


@click.group()
@click.version_option(package_name="tilertc")
def main() -> None:
    """tilertc: compile an LLM's decode step into one persistent CUDA kernel."""


def parse_overrides(pairs: tuple[str, ...]) -> dict:
    """`KEY=VALUE` pairs; VALUE is read as JSON (numbers, true, null, lists) or else as text."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {pair!r}", param_hint="--set")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


@main.command("inspect")
@click.argument("model")
@click.option("--target", type=click.Choice(sorted(TARGETS), case_sensitive=False),
              default="h200", show_default=True, help="GPU whose bandwidth sets the floor.")
@click.option("--max-seq-len", type=click.IntRange(min=1), default=None,
              help="KV-cache capacity, and the context at which KV reads are counted "
                   "[default: max positions, at most 4096].")
@click.option("--summary", is_flag=True, help="Show runs of identical layers once, with ×N.")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable JSON dict.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a config key before validation (repeatable).")
def inspect_command(model: str, target: str, max_seq_len: int | None, summary: bool,
                    as_json: bool, overrides: tuple[str, ...]) -> None:
    """Show the decode-step op graph of MODEL and the bytes each token reads.

    MODEL is a built-in name (e.g. llama-3.2-1b), a config.json, or a directory holding one.
    """
    from tilertc.inspect import inspect_model, print_inspection

    try:
        spec = load_spec(model, parse_overrides(overrides))
    except SpecError as e:
        raise click.ClickException(str(e)) from None
    if max_seq_len is not None and max_seq_len > spec.max_position_embeddings:
        raise click.BadParameter(f"{max_seq_len} exceeds the model's max_position_embeddings "
                                 f"{spec.max_position_embeddings}", param_hint="--max-seq-len")
    insp = inspect_model(spec, get_target(target), max_seq_len, summary)
    if as_json:
        click.echo(json.dumps(insp.to_dict(), indent=1, sort_keys=True))
    else:
        print_inspection(insp, report_console(160))


def report_console(width: int) -> Console:
    """The terminal, or, when output is piped or captured, a console `width` columns wide so
    that wide tables are not squeezed to 80 columns."""
    console = Console()
    return console if console.is_terminal else Console(width=width)


def kv_capacity(spec: ModelSpec, max_seq_len: int | None) -> int:
    """The KV capacity to compile for: as asked, else the model's context, at most 4096."""
    if max_seq_len is None:
        return min(spec.max_position_embeddings, 4096)
    if max_seq_len > spec.max_position_embeddings:
        raise click.BadParameter(f"{max_seq_len} exceeds the model's max_position_embeddings "
                                 f"{spec.max_position_embeddings}", param_hint="--max-seq-len")
    return max_seq_len


WEIGHT_DTYPE = click.option(
    "--weight-dtype", type=click.Choice(WEIGHT_DTYPES), default=None,
    help="Projection weights: fp8 (e4m3, one fp32 scale per 128x128 block; every family) or "
    "bf16 [default: the config's own, bf16 unless it has an FP8 quantization_config].")


def sampling_options(temperature_help: str) -> Callable[[Callable], Callable]:
    """--temperature (its help given: what sampling does for the command), --top-k, --top-p and
    --sample-seed, as `SamplingParams` takes them."""
    options = (
        click.option("--temperature", type=float, default=0.0, show_default=True,
                     help=temperature_help),
        click.option("--top-k", type=int, default=0, show_default=True,
                     help="Sample among the K most likely tokens (0: off)."),
        click.option("--top-p", type=float, default=1.0, show_default=True,
                     help="Sample within the nucleus of probability P."),
        click.option("--sample-seed", type=int, default=0, show_default=True,
                     help="Seed of the sampler (same seed, same tokens)."))

    def apply(command: Callable) -> Callable:
        for option in reversed(options):
            command = option(command)
        return command
    return apply


@main.command("compile")
@click.argument("model")
@click.option("-o", "--output", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Artifact directory to write (created if missing).")
@click.option("--target", type=click.Choice(sorted(TARGETS), case_sensitive=False),
              default="h200", show_default=True, help="GPU to compile for.")
@click.option("--backend", type=click.Choice(BACKENDS), default="cuda", show_default=True,
              help="Code generator.")
@click.option("--max-seq-len", type=click.IntRange(min=1), default=None,
              help="KV-cache capacity in positions [default: max positions, at most 4096].")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a config key before validation (repeatable).")
@WEIGHT_DTYPE
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True,
              help="Tensor-parallel ranks (GPUs of one NVLink host); one cubin runs on each.")
@click.option("--lineinfo", is_flag=True,
              help="Keep source lines in the cubin (for compute-sanitizer and Nsight).")
@click.option("--tune", multiple=True, metavar="KNOB=N",
              help="A schedule knob instead of the passes' choice (repeatable): compute_warps, "
                   "page_kb, page_groups, attn_chunks (attention's context chunks per KV or "
                   "head group, at most), router_tasks (the MoE router's tasks), ffn_split_k=1 "
                   "(each dense MLP as one split-K op), or "
                   "fp8_mma=0 or 1 (FP8 projections as rows on the CUDA cores or as tiles on the "
                   "tensor cores; by default whichever the cost model predicts faster), or "
                   "ready_digits=0 (each FP8 tile task converts its input to "
                   "digits itself, rather than the projection that makes it writing them), or "
                   "vexp_digits=1 (MLA's v expansion writes o_proj's input as digits).")
def compile_command(model: str, out_dir: str, target: str, backend: str,
                    max_seq_len: int | None, overrides: tuple[str, ...], weight_dtype: str | None,
                    tp: int, lineinfo: bool, tune: tuple[str, ...]) -> None:
    """Compile MODEL into one persistent CUDA kernel and write an artifact directory.

    MODEL is a built-in name (e.g. llama-3.2-1b), a config.json, or a directory holding one.
    Needs nvcc, not a GPU.
    """
    from tilertc.artifact import read_manifest
    from tilertc.bench import parse_tuning
    from tilertc.compile_report import StageDisplay, print_summary
    from tilertc.driver import CompileOptions, compile

    try:
        tuning = parse_tuning(tune)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--tune") from None
    try:
        spec = load_spec(model, parse_overrides(overrides))
    except SpecError as e:
        raise click.ClickException(str(e)) from None
    options = CompileOptions(target=target.lower(), backend=backend,
                             max_seq_len=kv_capacity(spec, max_seq_len), weight_dtype=weight_dtype,
                             tp=tp, lineinfo=lineinfo, **dict(tuning))
    console = Console(stderr=True)
    started = time.perf_counter()
    try:
        with StageDisplay(console) as stages:
            out = compile(spec, out_dir, options, progress=stages)
    except (ValueError, RuntimeError, FileNotFoundError) as e:  # schedule, nvcc
        raise click.ClickException(str(e)) from None
    print_summary(out, read_manifest(out), time.perf_counter() - started, Console())


@main.command("run")
@click.argument("artifact", type=click.Path(exists=True, file_okay=False))
@click.option("--weights", type=click.Path(exists=True),
              help="Hugging Face model directory or .safetensors file.")
@click.option("--random-weights", is_flag=True,
              help="Random weights (in the artifact's formats) instead of --weights.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of --random-weights.")
@click.option("--prompt", help="Prompt text (needs a tokenizer next to --weights).")
@click.option("--prompt-ids", help="Prompt as comma-separated token ids, e.g. 1,2,3.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=None,
              help="Tokens to generate at most [default: 128, or what fits the KV cache].")
@click.option("--eos-id", type=int, default=None,
              help="Stop at this token [default: the tokenizer's EOS, if there is a tokenizer].")
@sampling_options("0: greedy; otherwise sample in the kernel from softmax(logits / T).")
@click.option("--device", default="cuda:0", show_default=True)
def run_command(artifact: str, weights: str | None, random_weights: bool, seed: int,
                prompt: str | None, prompt_ids: str | None, max_new_tokens: int | None,
                eos_id: int | None, temperature: float, top_k: int, top_p: float,
                sample_seed: int, device: str) -> None:
    """Decode with a compiled ARTIFACT on a GPU, streaming tokens as the kernel makes them.

    Ctrl-C stops the kernel after the token in flight; a second Ctrl-C aborts.
    """
    from tilertc.artifact import check_capacity, model_spec, read_manifest
    from tilertc.engine import Engine
    from tilertc.token_stream import (
        TextStream,
        load_tokenizer,
        parse_ids,
        stop_on_interrupt,
        timed_stream,
        tokenizer_dir,
    )

    if (weights is None) == (not random_weights):
        raise click.UsageError("give exactly one of --weights and --random-weights")
    if (prompt is None) == (prompt_ids is None):
        raise click.UsageError("give exactly one of --prompt and --prompt-ids")
    try:
        SamplingParams(temperature, top_k, top_p, sample_seed)  # bad values fail before loading
        m = read_manifest(artifact)
        folder = tokenizer_dir(weights)
        tokenizer = load_tokenizer(folder) if folder else None
        if prompt is not None and tokenizer is None:
            raise ValueError("--prompt needs a tokenizer, and there is none "
                             + (f"next to {weights}" if weights else "with --random-weights")
                             + "; pass token ids with --prompt-ids")
        ids = tokenizer.encode(prompt) if prompt is not None else parse_ids(prompt_ids)
        vocab = model_spec(m).vocab_size
        if not ids or not all(0 <= i < vocab for i in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab}) and there must be some")
        if max_new_tokens is None:
            max_new_tokens = max(1, min(128, m["max_seq_len"] - len(ids) + 1))
        check_capacity(0, len(ids), max_new_tokens, m["max_seq_len"])
        if eos_id is None and tokenizer is not None:
            eos_id = tokenizer.eos_token_id
        engine = Engine.load(artifact, weights=weights, device=device, random_seed=seed)
    except (ValueError, RuntimeError, ImportError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None

    text = TextStream(tokenizer, ids) if tokenizer is not None else None
    if text is not None:
        click.echo(text.prompt_text, nl=False)

    def emit(token: int) -> None:
        click.echo(text.push(token) if text is not None else f"{token} ", nl=False)

    with stop_on_interrupt(engine.stop) as interrupted:
        try:
            tokens = engine.generate(ids, max_new_tokens, eos_id, temperature=temperature,
                                     top_k=top_k, top_p=top_p, seed=sample_seed)
            stats = timed_stream(tokens, emit)
        except RuntimeError as e:  # the kernel's watchdog or a driver error
            raise click.ClickException(str(e)) from None
    click.echo()
    why = "stopped by Ctrl-C; " if interrupted else ""
    click.echo(f"{stats.tokens} tokens in {stats.total_s:.2f} s ({why}first after "
               f"{stats.first_token_s * 1e3:.0f} ms, with a prefill of {len(ids) - 1} tokens): "
               f"{stats.tokens_per_s:.1f} tokens/s/user", err=True)


@main.command("explain")
@click.argument("model")
@click.option("--target", type=click.Choice(sorted(TARGETS), case_sensitive=False),
              default="h200", show_default=True, help="GPU to schedule for.")
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True,
              help="Tensor-parallel ranks; the schedule shown is one rank's.")
@click.option("--max-seq-len", type=click.IntRange(min=1), default=None,
              help="KV-cache capacity in positions [default: max positions, at most 4096].")
@click.option("--all-layers", is_flag=True, help="One row per layer instead of folding runs "
              "of identical layers into one row ×N.")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable JSON dict.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a config key before validation (repeatable).")
@WEIGHT_DTYPE
def explain_command(model: str, target: str, tp: int, max_seq_len: int | None,
                    all_layers: bool, as_json: bool, overrides: tuple[str, ...],
                    weight_dtype: str | None) -> None:
    """Explain the schedule of MODEL: per fused op its tile, tasks, SMs, pipeline depth,
    residency, roles and predicted time; the predicted latency; every decision.

    MODEL is a built-in name (e.g. llama-3.2-1b), a config.json, or a directory holding one.
    """
    from tilertc.explain import explain, print_explanation

    try:
        spec = with_weight_dtype(load_spec(model, parse_overrides(overrides)), weight_dtype)
        ex = explain(spec, target.lower(), tp, kv_capacity(spec, max_seq_len), not all_layers)
    except (SpecError, ValueError) as e:  # ScheduleError is a ValueError
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps(ex.to_dict(), indent=1, sort_keys=True))
    else:
        print_explanation(ex, report_console(200))


def _bench_points(context: int, gen: int, points: str | None) -> tuple[tuple[int, int], ...]:
    from tilertc.bench import check_points, parse_points

    try:
        parsed = parse_points(points) if points else ((context, gen),)
        check_points(parsed)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--points" if points else "--gen") from None
    return parsed


def _bench_sampling(temperature: float, top_k: int, top_p: float, seed: int, tp: int,
                    per_layer: bool) -> SamplingParams | None:
    """The sampling the bench times beside greedy decoding; None: greedy only."""
    if temperature == 0:
        if (top_k, top_p, seed) != (0, 1.0, 0):
            raise click.UsageError("--top-k, --top-p and --sample-seed go with --temperature")
        return None
    if per_layer or tp > 1:
        raise click.UsageError("--temperature times sampling on one GPU, not with "
                               + ("--per-layer" if per_layer else f"--tp {tp}"))
    try:
        return SamplingParams(temperature, top_k, top_p, seed)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--temperature/--top-k/--top-p") from None


@main.command("bench")
@click.argument("model")
@click.option("--context", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Prompt tokens prefilled before the timed decode.")
@click.option("--gen", type=click.IntRange(min=2), default=1024, show_default=True,
              help="Tokens decoded and timed.")
@click.option("--points", metavar="C/G,...", default=None,
              help="Several context/gen points in one run, e.g. 1k/1k,8k/1k "
                   "(instead of --context/--gen).")
@click.option("--systems", default=",".join(("tilertc", "hf-eager", "hf-graph",
                                             "kernel-per-op")), show_default=True,
              help="Systems to time, comma-separated; tilertc is required.")
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True,
              help="Tensor-parallel ranks to compile for.")
@click.option("--weights", type=click.Path(exists=True),
              help="Hugging Face model directory or .safetensors file [default: random bf16].")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed of the random weights and prompts.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Where bench.json, bench.png, timeline.png and a compiled artifact go "
                   "[default: ./bench-MODEL].")
@click.option("--profile", is_flag=True, help="Also profile a few steps of the kernel: a per-op "
              "table and timeline.png.")
@click.option("--tune", multiple=True, metavar="KNOB=N",
              help="Compile with a schedule knob set (compute_warps, page_kb, page_groups, "
                   "attn_chunks, router_tasks, ffn_split_k=0/1, fp8_mma=0/1, ready_digits=0/1, "
                   "vexp_digits=0/1) instead of the passes' choice (repeatable).")
@click.option("--backend", "backends", default="cuda", show_default=True, metavar="NAME,...",
              help="Compile and time one kernel per backend, e.g. cuda,tilelang; the first is "
                   "reported as tilertc, the others as tilertc-BACKEND.")
@click.option("--artifact", "artifacts", multiple=True, type=click.Path(exists=True,
              file_okay=False), help="Also time this prebuilt artifact of the same model "
              "(e.g. a TileLang build from a machine with TileLang; repeatable).")
@click.option("--rounds", type=click.IntRange(min=1), default=1, show_default=True,
              help="Time each kernel (tilertc, --backend, --artifact) this many times, taking "
                   "turns in alternating order, all loaded at once (GPU memory for each); the "
                   "tables give the statistics over every round's tokens. For comparing "
                   "kernels whose difference is small.")
@WEIGHT_DTYPE
@click.option("--per-layer", is_flag=True,
              help="Time one full-width layer of each kind (dense, MoE) by difference of a "
                   "1-layer and a (1 + N)-layer variant, against its bytes, and project the "
                   "whole model on 8 GPUs (a projection, not a measurement).")
@sampling_options("Not 0: also time each tilertc kernel sampling in the kernel from "
                  "softmax(logits / T), as `tilertc run` does (rows 'NAME sampled'); the "
                  "correctness gate and the baselines stay greedy.")
@click.option("--layers-timed", type=click.IntRange(min=1), default=None,
              help="--per-layer: N [default: 4, or fewer where 1 + N layers do not fit].")
@click.option("--allreduce-us", type=click.FloatRange(min=0), default=None,
              help="--per-layer: assumed latency of one all-reduce on 8 GPUs in the projection "
                   "[default: 10, see docs/performance.md].")
@click.option("--device", default="cuda:0", show_default=True)
def bench_command(model: str, context: int, gen: int, points: str | None, systems: str,
                  tp: int, weights: str | None, seed: int, out_dir: str | None, profile: bool,
                  tune: tuple[str, ...], backends: str, artifacts: tuple[str, ...],
                  rounds: int, weight_dtype: str | None, per_layer: bool,
                  temperature: float, top_k: int, top_p: float, sample_seed: int,
                  layers_timed: int | None, allreduce_us: float | None, device: str) -> None:
    """Benchmark MODEL's persistent kernel against Hugging Face eager, Hugging Face in a CUDA
    graph and a kernel-per-op engine, on one GPU, with the same weights and prompt.

    MODEL is a built-in name, a config.json (or a directory holding one), or an artifact
    directory. A correctness gate runs first; if the kernel does not compute the model, no
    numbers are reported. Results: a table per point, bench.json and bench.png in --out.
    With --per-layer: a table of one layer per kind and the projection, and bench.json.
    """
    import os
    import sys
    from pathlib import Path

    from click.core import ParameterSource

    # A large model's weights held twice (the interpreter's and the kernel's packed copy) leave
    # little room: torch's allocator grows segments rather than fragmenting what is left.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    from tilertc.artifact import ArtifactError
    from tilertc.bench import (
        BenchConfig,
        finish,
        parse_backends,
        parse_systems,
        parse_tuning,
        run_bench,
        stage_phases,
    )

    try:
        chosen = parse_systems(systems)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--systems") from None
    if per_layer and click.get_current_context().get_parameter_source(
            "systems") is ParameterSource.DEFAULT:
        chosen = ("tilertc",)  # the baselines do not run the variants
    if not per_layer and (layers_timed is not None or allreduce_us is not None):
        raise click.UsageError("--layers-timed and --allreduce-us go with --per-layer")
    sampling = _bench_sampling(temperature, top_k, top_p, sample_seed, tp, per_layer)
    try:
        tuning = parse_tuning(tune)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--tune") from None
    try:
        chosen_backends = parse_backends(backends)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--backend") from None
    name = Path(model).name.removesuffix(".json") or "model"
    config = BenchConfig(model=model, points=_bench_points(context, gen, points),
                         out=Path(out_dir or f"bench-{name}"), systems=chosen, weights=weights,
                         seed=seed, tp=tp, device=device, profile=profile, tuning=tuning,
                         backends=chosen_backends, artifacts=tuple(map(Path, artifacts)),
                         rounds=rounds, weight_dtype=weight_dtype, sampling=sampling,
                         command=" ".join(["tilertc", *sys.argv[1:]]))
    console = Console()
    if not console.is_terminal:  # piped or captured: do not squeeze the tables to 80 columns
        console = Console(width=160)
    try:
        with stage_phases(Console(stderr=True)) as phase:
            if per_layer:
                from tilertc.bench_layers import ALLREDUCE_US, finish_per_layer, run_per_layer

                layers = run_per_layer(config, layers_timed, ALLREDUCE_US if allreduce_us is None
                                       else allreduce_us, phase)
            else:
                report, prof = run_bench(config, phase)
        written = (finish_per_layer(layers, config.out, console) if per_layer
                   else finish(report, prof, config.out, console))
    except (SpecError, ArtifactError, ValueError, RuntimeError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None
    console.print("wrote " + ", ".join(str(p) for p in written), highlight=False)
