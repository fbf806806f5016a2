"""`--backend tilelang`: TileLang's tiles composed into the CUDA backend's persistent skeleton.

Without TileLang (the project's own environment): the clear error naming the install, the tile
shapes the schedule asks for, and the composition on TileLang-shaped source. With TileLang
0.1.15 importable (skipped otherwise, saying why): real lowering on this CPU machine for
sm_90a, and artifacts that build with nvcc into one kernel entry and one `__global__`.

On a GPU (`gpu` marker): the kernel against the interpreter, by the same checks as
tests/test_cuda_kernel.py. The GPU machine has no TileLang, so those tests load artifacts
compiled here when TILERTC_TILELANG_ARTIFACTS names a directory of them (one per model, built
with `tilertc compile MODEL -o DIR/MODEL --backend tilelang --max-seq-len 512`), else compile.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import tilertc
from tilertc.artifact import check_artifact, global_functions, read_manifest
from tilertc.backends.cuda import codegen
from tilertc.backends.tilelang.compose import (
    SEAM,
    CompositionError,
    compose,
    device_function,
)
from tilertc.backends.tilelang.requirement import INSTALL_HINT, TileLangMissing, load_tilelang
from tilertc.backends.tilelang.segments import row_segments, segment_lengths, warps_per_row
from tilertc.cli import main
from tilertc.driver import CompileOptions, compile
from tilertc.passes.pipeline import make_program

DENSE_TINY = ["llama-tiny", "qwen3-tiny", "llama-tiny-odd"]
SEQ = 512


def tilelang_missing() -> str | None:
    try:
        load_tilelang()
    except TileLangMissing as e:
        return str(e)
    return None


def nvcc_missing() -> str | None:
    try:
        codegen.find_nvcc()
    except FileNotFoundError as e:
        return str(e)
    return None


MISSING = tilelang_missing()
needs_tilelang = pytest.mark.skipif(MISSING is not None, reason=f"TileLang: {MISSING}")
needs_nvcc = pytest.mark.skipif(nvcc_missing() is not None, reason="nvcc is needed to compile")


@pytest.fixture
def no_tilelang(monkeypatch: pytest.MonkeyPatch) -> None:
    """`import tilelang` fails, whether or not it is installed here."""
    monkeypatch.setitem(sys.modules, "tilelang", None)


# -- the optional dependency ----------------------------------------------------------------
def test_compile_without_tilelang_names_the_install(no_tilelang: None, tmp_path: Path) -> None:
    out = tmp_path / "art"
    with pytest.raises(TileLangMissing, match=r"pip install \"tilertc\[tilelang\]\""):
        compile(tilertc.load_spec("llama-tiny"), out, CompileOptions(backend="tilelang"))
    assert not out.exists()  # refused before scheduling, nothing written


def test_cli_compile_without_tilelang_is_one_error_line(no_tilelang: None, tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["compile", "llama-tiny", "-o", str(tmp_path / "art"),
                                       "--backend", "tilelang"])
    assert result.exit_code == 1
    assert "Traceback" not in result.output and INSTALL_HINT in result.output


def test_another_tilelang_release_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tilelang", types.SimpleNamespace(__version__="0.1.14"))
    with pytest.raises(TileLangMissing, match="pinned to TileLang 0.1.15, found 0.1.14"):
        load_tilelang()


# -- tile shapes from the schedule ----------------------------------------------------------
def test_warps_per_row_follows_the_kernel_rule() -> None:
    # 16 warps per page group: a page of 16+ rows gives one warp a row; of 4 rows, 4 warps a row
    assert [warps_per_row(r, 16) for r in (1, 3, 4, 8, 16, 40)] == [16, 4, 4, 2, 1, 1]


@pytest.mark.parametrize(("k_pieces", "wpr"), [(8, 16), (256, 1), (1024, 4), (72, 2), (36, 8)])
def test_row_segments_cover_the_row(k_pieces: int, wpr: int) -> None:
    segs = row_segments(k_pieces, wpr)
    assert sum(segs) == k_pieces and len(segs) <= wpr and all(s > 0 for s in segs)


def test_segment_lengths_of_llama_3_2_1b() -> None:
    # 64 KB pages, 16 compute warps: qkv/o/lm_head rows (4 KB) 16 to a page, one warp per row
    # (256 pieces); gate/up rows (8 KB, both halves) 8 to a page, 2 warps per row (128 pieces
    # of each half); down rows (16 KB) 4 to a page, 4 warps per row (256 pieces)
    lengths = segment_lengths(make_program(tilertc.load_spec("llama-3.2-1b"), "h200", 1, SEQ))
    assert sorted(lengths) == [128, 256]
    assert all(name.endswith("gate_up_proj") for name in lengths[128])
    assert "lm_head" in lengths[256] and "layers.0.ffn.down_proj" in lengths[256]


# -- composition, on TileLang-shaped source -------------------------------------------------
def tile_source(body: str, threads: int = 32) -> str:
    """A CUDA source shaped like TileLang 0.1.15's output for one tile."""
    params = "const bfloat16_t* __restrict__ w, const float* __restrict__ x, float* __restrict__ y"
    return ("#include <tl_templates/cuda/reduce.h>\n\n"
            f'extern "C" __global__ void row_segment_kernel({params});\n'
            f'extern "C" __global__ void __launch_bounds__({threads}, 1) '
            f"row_segment_kernel({params}) {{\n{body}}}\n")


def test_a_tile_becomes_a_device_function_of_one_warp() -> None:
    f = device_function(tile_source("  if (((int)threadIdx.x) == 0) { y[0] = 0.f; }\n"),
                        "row_segment_4", 32)
    assert f.text.startswith("__device__ __forceinline__ void row_segment_4(")
    assert f.text.count("int tl_lane)") == 1 and "threadIdx" not in f.text
    assert "__global__" not in f.prelude and "reduce.h" in f.prelude


@pytest.mark.parametrize(("body", "threads", "message"), [
    ("  __syncthreads();\n", 32, "__syncthreads"),
    ("  tl::__sync_thread_partial(3, 256);\n", 32, "__sync_thread_partial"),
    ("  y[blockIdx.x] = 0.f;\n", 32, "blockIdx"),
    ("  y[0] = 0.f;\n", 160, "launches it with 160 threads"),
])
def test_a_tile_needing_more_than_its_warp_is_refused(body: str, threads: int,
                                                      message: str) -> None:
    with pytest.raises(CompositionError, match=message):
        device_function(tile_source(body, threads), "row_segment_4", 32)


def test_composed_source_keeps_one_global_and_routes_the_seam() -> None:
    program = make_program(tilertc.load_spec("llama-tiny"), "h200", 1, SEQ)
    cuda = codegen.emit_source(program)
    f = device_function(tile_source("  y[0] = 0.f;\n"), "row_segment_1", 32)
    src = compose(cuda, [f], {1: "row_segment_1"})
    assert global_functions(src) == 1
    assert "case 1: tilertc_tl::row_segment_1(" in src
    simt = SEAM.replace("dot_segment(", "dot_segment_simt(")
    assert src.count(SEAM) == 1 and src.count(simt) == 1  # the dispatcher, then the CUDA loop
    assert src.index(SEAM) < src.index(simt)


def test_a_skeleton_without_the_seam_is_refused() -> None:
    with pytest.raises(CompositionError, match="dot_segment seam"):
        compose("__global__ void k() {}\n", [], {})


# -- with TileLang: real lowering and artifacts -----------------------------------------------
@needs_tilelang
@pytest.mark.parametrize("pieces", [1, 18, 36, 128, 192, 256, 1024])
def test_tilelang_lowers_the_row_segment_tile_for_sm90a(pieces: int) -> None:
    from tilertc.backends.tilelang.tiles import lower_to_cuda, row_segment_tile

    tilelang = load_tilelang()
    source = lower_to_cuda(tilelang, row_segment_tile(tilelang, 8 * pieces), "sm_90a")
    f = device_function(source, f"row_segment_{pieces}", 32)  # one warp, nothing block-wide
    assert "tl_lane" in f.text


HOST_TILE = Path(__file__).with_name("tilelang_tile_host.cpp")


@needs_tilelang
@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ runs the tile on the host")
@pytest.mark.parametrize("pieces", [1, 18, 36, 128, 192, 256])
def test_tilelang_tile_computes_the_segment_dot_product(pieces: int, tmp_path: Path) -> None:
    """The lowered tile, run on the host lane by lane (tilelang_tile_host.cpp), against float64:
    the check that caught TileLang computing part of a product (see tiles.py)."""
    from tilertc.backends.tilelang.tiles import lower_to_cuda, row_segment_tile

    tilelang = load_tilelang()
    n = 8 * pieces
    f = device_function(lower_to_cuda(tilelang, row_segment_tile(tilelang, n), "sm_90a"),
                        f"row_segment_{pieces}", 32)
    (tmp_path / "tile.inc").write_text(
        f"namespace tilertc_tl {{\n{f.text}}}\n#define TILE tilertc_tl::{f.name}\n")
    exe = tmp_path / "tile"
    subprocess.run(["g++", "-std=c++17", "-O1", "-fno-strict-aliasing", f"-I{tmp_path}", "-o",
                    str(exe), str(HOST_TILE)], check=True, capture_output=True)
    gen = torch.Generator().manual_seed(pieces)
    w = torch.randn(n, generator=gen).to(torch.bfloat16)
    x = torch.randn(n, generator=gen).numpy()
    stdin = "\n".join([str(n), " ".join(map(str, w.view(torch.int16).numpy().view(np.uint16))),
                       " ".join(map(str, x.view(np.uint32)))])
    out = subprocess.run([str(exe)], input=stdin, capture_output=True, text=True, check=True)
    got = float(np.uint32(int(out.stdout)).view(np.float32))
    terms = w.double().numpy() * x.astype(np.float64)
    assert abs(got - terms.sum()) <= 1e-5 * np.abs(terms).sum()


@pytest.fixture(scope="module")
def cuda_tasks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    """The CUDA backend's task tables of the tiny models, which the TileLang backend shares."""
    out = {}
    for model in DENSE_TINY:
        art = compile(tilertc.load_spec(model), tmp_path_factory.mktemp(f"cuda-{model}"),
                      CompileOptions(max_seq_len=SEQ))
        out[model] = np.load(art / "schedule.npz")["tasks"]
    return out


@needs_tilelang
@needs_nvcc
@pytest.mark.parametrize("model", DENSE_TINY)
def test_tilelang_artifact_is_one_kernel(model: str, tmp_path: Path,
                                         cuda_tasks: dict[str, np.ndarray]) -> None:
    spec = tilertc.load_spec(model)
    art = compile(spec, tmp_path, CompileOptions(backend="tilelang", max_seq_len=SEQ))
    m = check_artifact(art)  # one kernel entry in the cubin, one __global__ in kernel.cu
    assert m["options"]["backend"] == "tilelang" and m["target"]["arch"] == "sm_90a"
    record = m["tilelang"]
    program = make_program(spec, "h200", 1, SEQ)
    assert record["tilelang_version"] == "0.1.15"
    assert [t["pieces"] for t in record["tiles"]] == list(segment_lengths(program))
    source = (art / "kernel.cu").read_text()
    assert all(f"void {t['name']}(" in source for t in record["tiles"])
    assert np.array_equal(np.load(art / "schedule.npz")["tasks"], cuda_tasks[model])


# -- on a GPU: the same checks as the CUDA backend's kernel ------------------------------------
@pytest.fixture(scope="module", params=DENSE_TINY)
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    from tilertc.engine import Engine

    prebuilt = os.environ.get("TILERTC_TILELANG_ARTIFACTS")
    if prebuilt:
        art = Path(prebuilt) / request.param
    elif MISSING is not None:
        pytest.skip(f"no TILERTC_TILELANG_ARTIFACTS and TileLang cannot compile here: {MISSING}")
    else:
        art = compile(tilertc.load_spec(request.param), tmp_path_factory.mktemp(request.param),
                      CompileOptions(backend="tilelang", max_seq_len=SEQ))
    assert read_manifest(art)["options"]["backend"] == "tilelang"
    return Engine.load(art, random_seed=1234)


@pytest.mark.gpu
def test_teacher_forced_logits_match_interpreter(engine) -> None:
    import test_cuda_kernel

    test_cuda_kernel.test_teacher_forced_logits_match_interpreter(engine)


@pytest.mark.gpu
def test_token_loop_equals_single_steps(engine) -> None:
    import test_cuda_kernel

    test_cuda_kernel.test_token_loop_equals_single_steps(engine)


@pytest.mark.gpu
def test_eos_stops_the_loop(engine) -> None:
    import test_cuda_kernel

    test_cuda_kernel.test_eos_stops_the_loop(engine)
