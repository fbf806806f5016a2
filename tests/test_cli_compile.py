"""`tilertc compile` and `tilertc run` on a machine with nvcc and no GPU.

`compile` is exercised for real (tiny models, a second or so of nvcc each). `run` is checked up
to the GPU: its argument and prompt errors, the clean no-GPU error, and, with a stand-in for
the engine, the streaming of ids and text, the EOS default, the rate line and Ctrl-C.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result
from rich.console import Console

from tilertc.artifact import check_artifact, read_manifest
from tilertc.backends.cuda import codegen
from tilertc.cli import main
from tilertc.compile_report import print_summary
from tilertc.engine import Engine
from tilertc.token_stream import TextStream

SEQ = 64

try:
    codegen.find_nvcc()
except FileNotFoundError:
    pytest.skip("nvcc is needed to compile", allow_module_level=True)


def cli(*args: str) -> Result:
    result = CliRunner().invoke(main, list(args))
    assert "Traceback" not in result.output
    return result


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "llama-tiny"
    result = cli("compile", "llama-tiny", "-o", str(out), "--max-seq-len", str(SEQ))
    assert result.exit_code == 0, result.output
    return out


# -- compile --------------------------------------------------------------------------------
def test_compile_writes_a_checked_artifact_and_reports_it(artifact: Path) -> None:
    m = check_artifact(artifact)
    assert m["max_seq_len"] == SEQ and m["target"]["arch"] == "sm_90a"
    result = cli("compile", "llama-tiny", "-o", str(artifact), "--max-seq-len", str(SEQ))
    assert result.exit_code == 0
    for stage in ("scheduling", "emitting CUDA source", "compiling with nvcc for sm_90a"):
        assert stage in result.stderr
    for fact in (str(artifact), "registers/thread", "no spills", "/token by the cost model"):
        assert fact in result.stdout


def test_kernel_source_is_the_device_librarys_parts_in_order(artifact: Path) -> None:
    """kernel.cu holds every part of backends/cuda/decode/ once, in `LIBRARY`'s order (each
    uses what the ones before it define), and the folder has no part that `LIBRARY` leaves out."""
    assert sorted(codegen.LIBRARY_DIR.glob("*.cuh")) == sorted(codegen.LIBRARY)
    src = (artifact / "kernel.cu").read_text()
    at = [src.index(f"// backends/cuda/decode/{part.name}\n{part.read_text()}")
          for part in codegen.LIBRARY]
    assert at == sorted(at) and len(set(at)) == len(at)


def test_the_summary_names_the_fp8_path_the_compiler_chose(artifact: Path) -> None:
    """Where make_program chose between FP8 tiles and rows, the summary's weights row says
    which and why; a bf16 build's has no such line (here a manifest with the decision added)."""
    m = check_artifact(artifact)
    chose = ("FP8 projections as rows on the CUDA cores: the cost model predicts 2.892 ms a "
             "step with tiles, 2.791 with rows")
    said = [*m["decisions"], f"[tiling] {chose}"]
    for decisions, want in ((m["decisions"], False), (said, True)):
        console = Console(record=True, width=400, force_terminal=False)
        print_summary(artifact, {**m, "decisions": decisions}, 1.0, console)
        text = console.export_text()
        assert ("packed; " + chose in text) == want and "packed" in text


def test_compile_for_another_target(tmp_path: Path) -> None:
    result = cli("compile", "qwen3-tiny", "-o", str(tmp_path), "--target", "B200")
    assert result.exit_code == 0, result.output
    m = check_artifact(tmp_path)
    assert m["target"] == {"name": "b200", "arch": "sm_100a", "num_sms": 148}
    assert m["max_seq_len"] == 2048  # the tiny config's max_position_embeddings (< 4096)


def test_compile_with_overrides(tmp_path: Path) -> None:
    result = cli("compile", "llama-tiny", "-o", str(tmp_path), "--set", "num_hidden_layers=1")
    assert result.exit_code == 0, result.output
    assert read_manifest(tmp_path)["model"]["spec"]["num_layers"] == 1


def test_compile_with_lineinfo(artifact: Path, tmp_path: Path) -> None:
    result = cli("compile", "llama-tiny", "-o", str(tmp_path), "--max-seq-len", str(SEQ),
                 "--lineinfo")
    assert result.exit_code == 0, result.output
    assert read_manifest(tmp_path)["options"]["lineinfo"] is True
    assert b".debug_line" in (tmp_path / "kernel.cubin").read_bytes()
    assert b".debug_line" not in (artifact / "kernel.cubin").read_bytes()


@pytest.mark.parametrize(("args", "message"), [
    (["--target", "a100"], "Invalid value for '--target'"),
    (["--backend", "triton"], "Invalid value for '--backend'"),
    (["--max-seq-len", "100000"], "exceeds the model's max_position_embeddings 2048"),
    (["--set", "hidden_size"], "expected KEY=VALUE"),
])
def test_compile_usage_errors(tmp_path: Path, args: list[str], message: str) -> None:
    result = cli("compile", "llama-tiny", "-o", str(tmp_path), *args)
    assert result.exit_code == 2 and message in result.output
    assert not (tmp_path / "manifest.json").exists()


def test_compile_unknown_model(tmp_path: Path) -> None:
    result = cli("compile", "llama-tinyy", "-o", str(tmp_path))
    assert result.exit_code == 1 and "did you mean llama-tiny" in result.output


@pytest.mark.parametrize("name, args, lacks", [
    ("glm-5-tiny", ["--set", "index_head_dim=18"],
     "not yet in the CUDA backend: index key rows of 18 values"),
    ("deepseek-v3.2-tiny", ["--set", "index_head_dim=10"],
     "not yet in the CUDA backend: index key rows of 10 values")])
def test_compile_a_model_the_backend_cannot_schedule(tmp_path: Path, name: str, args: list[str],
                                                     lacks: str) -> None:
    result = cli("compile", name, "-o", str(tmp_path), *args)
    assert result.exit_code == 1 and "Error:" in result.output
    # it schedules; codegen refuses it, naming what it lacks
    assert lacks in result.stderr


def test_compile_without_nvcc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def missing() -> str:
        raise FileNotFoundError("nvcc not found: install the CUDA toolkit")

    monkeypatch.setattr(codegen, "find_nvcc", missing)
    result = cli("compile", "llama-tiny", "-o", str(tmp_path))
    assert result.exit_code == 1 and "Error: nvcc not found" in result.output


# -- run: errors before the GPU -------------------------------------------------------------
@pytest.mark.parametrize(("args", "message"), [
    (["--prompt-ids", "1"], "exactly one of --weights and --random-weights"),
    (["--random-weights"], "exactly one of --prompt and --prompt-ids"),
    (["--random-weights", "--prompt", "hi", "--prompt-ids", "1"], "exactly one of --prompt"),
])
def test_run_usage_errors(artifact: Path, args: list[str], message: str) -> None:
    result = cli("run", str(artifact), *args)
    assert result.exit_code == 2 and message in result.output


@pytest.mark.parametrize(("args", "message"), [
    (["--prompt", "hello"], "--prompt needs a tokenizer, and there is none with --random-weights; "
                            "pass token ids with --prompt-ids"),
    (["--prompt-ids", "1,x"], "comma-separated integers"),
    (["--prompt-ids", "1,256"], "must be in [0, 256)"),
    (["--prompt-ids", ",".join(["1"] * (SEQ + 1))], f"a prompt of {SEQ + 1} tokens at position 0 "
                                                   f"exceeds the KV capacity of {SEQ} positions"),
    (["--prompt-ids", "1,2", "--max-new-tokens", str(SEQ)], "at most 63 new tokens fit"),
    (["--prompt-ids", "1,2", "--top-k", "100"], "top_k must be an integer from 0 (off) to 64"),
    (["--prompt-ids", "1,2", "--temperature", "-1"], "temperature must be 0 (greedy)"),
    (["--prompt-ids", "1,2", "--temperature", "1", "--top-p", "0"], "top_p must be a number"),
])
def test_run_prompt_errors(artifact: Path, args: list[str], message: str) -> None:
    result = cli("run", str(artifact), "--random-weights", *args)
    assert result.exit_code == 1 and message in result.output


def test_run_on_a_directory_that_is_no_artifact(tmp_path: Path) -> None:
    result = cli("run", str(tmp_path), "--random-weights", "--prompt-ids", "1")
    assert result.exit_code == 1 and "not a tilertc artifact" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message on a machine without a GPU")
def test_run_without_a_gpu(artifact: Path) -> None:
    result = cli("run", str(artifact), "--random-weights", "--prompt-ids", "1,2,3")
    assert result.exit_code == 1 and "Error: no CUDA GPU is available" in result.output


# -- run: streaming, with a stand-in engine --------------------------------------------------
class StandInEngine:
    """Yields fixed tokens like Engine.generate; with `interrupt_after`, sends itself SIGINT
    after that many tokens, and honours `stop` as the kernel does (after the token in flight)."""

    def __init__(self, tokens: list[int], interrupt_after: int | None = None) -> None:
        self.tokens, self.interrupt_after = tokens, interrupt_after
        self.stopped = False
        self.calls: list[tuple[list[int], int, int | None]] = []
        self.sampling: list[dict] = []

    def generate(self, ids: list[int], max_new_tokens: int, eos_token_id: int | None = None,
                 **sampling: float) -> Iterator[int]:
        self.calls.append((list(ids), max_new_tokens, eos_token_id))
        self.sampling.append(sampling)
        for n, token in enumerate(self.tokens[:max_new_tokens], start=1):
            if self.stopped:
                return
            yield token
            if n == self.interrupt_after:
                os.kill(os.getpid(), signal.SIGINT)

    def stop(self) -> None:
        self.stopped = True


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch):
    def install(engine: StandInEngine) -> list[dict]:
        loads: list[dict] = []

        def load(artifact, **kwargs):
            loads.append(kwargs)
            return engine

        monkeypatch.setattr(Engine, "load", load)
        return loads

    return install


def test_run_streams_ids_and_reports_the_rate(artifact: Path, stand_in) -> None:
    engine = StandInEngine([5, 6, 7, 8])
    loads = stand_in(engine)
    result = cli("run", str(artifact), "--random-weights", "--seed", "3", "--prompt-ids", "1, 2,3",
                 "--max-new-tokens", "3", "--eos-id", "9", "--device", "cuda:1")
    assert result.exit_code == 0, result.output
    assert result.stdout == "5 6 7 \n"
    assert engine.calls == [([1, 2, 3], 3, 9)]
    assert engine.sampling == [{"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0}]
    assert loads == [{"weights": None, "device": "cuda:1", "random_seed": 3}]
    assert "3 tokens in" in result.stderr and "tokens/s/user" in result.stderr


def test_run_passes_the_sampling_flags_to_the_engine(artifact: Path, stand_in) -> None:
    engine = StandInEngine([5, 6])
    stand_in(engine)
    result = cli("run", str(artifact), "--random-weights", "--prompt-ids", "1", "--temperature",
                 "0.8", "--top-k", "40", "--top-p", "0.9", "--sample-seed", "17")
    assert result.exit_code == 0, result.output
    assert engine.sampling == [{"temperature": 0.8, "top_k": 40, "top_p": 0.9, "seed": 17}]


def test_ctrl_c_stops_after_the_token_in_flight(artifact: Path, stand_in) -> None:
    engine = StandInEngine(list(range(10, 20)), interrupt_after=2)
    stand_in(engine)
    handler = signal.getsignal(signal.SIGINT)
    result = cli("run", str(artifact), "--random-weights", "--prompt-ids", "1")
    assert result.exit_code == 0, result.output
    assert result.stdout == "10 11 \n" and engine.stopped
    assert "2 tokens in" in result.stderr and "stopped by Ctrl-C" in result.stderr
    assert signal.getsignal(signal.SIGINT) is handler


@pytest.fixture
def tokenizer_dir(tmp_path: Path) -> Path:
    """A word-level tokenizer saved as a Hugging Face model directory would hold it."""
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    vocab = {w: i for i, w in enumerate(["<unk>", "</s>", "hello", "world", "again", "and"])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()  # joins words with spaces
    folder = tmp_path / "weights"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "unk_token": "<unk>"}))
    return folder


def test_run_streams_text_with_the_weights_tokenizer(artifact: Path, stand_in,
                                                     tokenizer_dir: Path) -> None:
    engine = StandInEngine([4, 3, 2, 1])
    stand_in(engine)
    result = cli("run", str(artifact), "--weights", str(tokenizer_dir), "--prompt", "hello world")
    assert result.exit_code == 0, result.output
    assert engine.calls == [([2, 3], SEQ - 1, 1)]  # what fits; EOS from the tokenizer
    assert result.stdout == "hello world again world hello\n"  # EOS itself is not printed


def test_run_tokenizer_without_transformers(artifact: Path, tokenizer_dir: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)
    result = cli("run", str(artifact), "--weights", str(tokenizer_dir), "--prompt-ids", "2")
    assert result.exit_code == 1 and "transformers is not installed" in result.output


class BytesTokenizer:
    """One token per UTF-8 byte, decoded as transformers does (invalid bytes become U+FFFD)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_text_stream_holds_back_incomplete_characters() -> None:
    stream = TextStream(BytesTokenizer(), list("ü".encode()))
    pieces = [stream.push(b) for b in "aé€".encode()]
    assert stream.prompt_text == "ü" and pieces == ["a", "", "é", "", "", "€"]


def test_python_dash_m_runs_the_same_command() -> None:
    """`python -m tilertc` is the `tilertc` command (for a Python whose scripts are not on PATH)."""
    done = subprocess.run([sys.executable, "-m", "tilertc", "compile", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Usage: tilertc compile [OPTIONS] MODEL")
    assert "--weight-dtype" in done.stdout
