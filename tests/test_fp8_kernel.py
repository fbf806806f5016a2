"""FP8 e4m3 block-scaled weights through the passes, the artifact, the packing and the kernel's
dot product, on a CPU (the kernel against the interpreter on a GPU: tests/test_cuda_kernel.py).

- the two ways to ask for FP8 (`weight_dtype`, a config's quantization_config) give one spec;
  what is not supported yet (--tp, TileLang) is refused by name;
- the passes count FP8 rows as their e4m3 bytes plus their block scales, padded (before: two
  bytes per weight), and the schedule verifier passes on FP8 models;
- the packed buffer, read back row by row from the task table, dequantizes to the
  interpreter's weights;
- the device library's FP8 dot product, compiled for the host, against float64 math;
- `tilertc compile --weight-dtype fp8` writes a checked artifact.
"""

from __future__ import annotations

import math
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import tilertc
from tilertc.artifact import WeightMismatch, check_artifact, check_weights, read_manifest
from tilertc.backends.cuda import codegen
from tilertc.backends.cuda.encode import FIELDS, WEIGHT_FORMATS, encode
from tilertc.cli import main
from tilertc.driver import CompileOptions, compile
from tilertc.engine import pack_weights
from tilertc.ir.fp8 import (
    expand_blocks,
    pack_rows,
    packed_row_bytes,
    quantize,
    row_scales,
    tile_rows,
)
from tilertc.ir.interpreter import Interpreter
from tilertc.ir.weights import quantize_unscaled, random_weights
from tilertc.model_specs import SpecError, load_spec
from tilertc.model_specs.hf import FP8_QUANTIZATION, with_weight_dtype
from tilertc.passes.pipeline import make_program
from tilertc.passes.program import ScheduleError
from tilertc.passes.verify import verify

SEQ = 64
DENSE_TINY = ["llama-tiny", "qwen3-tiny", "llama-tiny-odd"]


def fp8(name: str) -> tilertc.ModelSpec:
    return with_weight_dtype(load_spec(name), "fp8")


def needs_nvcc() -> None:
    try:
        codegen.find_nvcc()
    except FileNotFoundError:
        pytest.skip("nvcc is needed to compile")


# -- asking for FP8 ---------------------------------------------------------------------------
def test_both_ways_to_ask_for_fp8_give_one_spec() -> None:
    by_option = fp8("llama-3.2-1b")
    by_config = load_spec("llama-3.2-1b", {"quantization_config": FP8_QUANTIZATION})
    assert by_option == by_config and by_option.content_hash() == by_config.content_hash()
    fmt = by_option.weight_format
    assert (fmt.dtype, fmt.block) == ("fp8_e4m3", (128, 128))
    assert by_option.hf_config["quantization_config"] == FP8_QUANTIZATION  # what the runtime reads
    assert with_weight_dtype(load_spec("llama-3.2-1b"), None) == load_spec("llama-3.2-1b")
    assert with_weight_dtype(by_option, "bf16") == load_spec("llama-3.2-1b")
    assert not with_weight_dtype(load_spec("deepseek-v3.2"), "bf16").weight_format.is_fp8
    with pytest.raises(SpecError, match="weight dtype 'int4' is not one of bf16, fp8"):
        with_weight_dtype(by_option, "int4")


def test_fp8_with_tensor_parallelism_where_shards_fall_on_scale_blocks() -> None:
    """Llama-3.1-8B at tp 8 cuts every weight on a 128-block boundary (512 q rows, one 128-row
    KV head, 512 o_proj inputs, 1792 MLP rows per rank): scheduled, FP8 rows throughout.
    llama-tiny's 32 q rows per rank would cut a block: refused naming the weight, with the
    bf16 way out."""
    spec = with_weight_dtype(load_spec("llama-3.1-8b", overrides={"num_hidden_layers": 1}), "fp8")
    p = make_program(spec, tp=8, max_seq_len=SEQ)
    cut = [t for t in p.graph.weights() if "shard" in t.attrs and "scale_inv" in t.attrs]
    assert len(cut) == 7 and all(t.dtype == "fp8_e4m3" for t in cut)  # q k v o gate up down
    assert all(p.graph.tensors[t.attrs["scale_inv"]].attrs["shard"] == t.attrs["shard"]
               for t in cut)
    with pytest.raises(ScheduleError, match=r"--tp 2: FP8 weight 'model.layers.0.self_attn."
                                            r"q_proj.weight' .*--weight-dtype bf16"):
        make_program(fp8("llama-tiny"), tp=2, max_seq_len=SEQ)


def test_tilelang_backend_refuses_fp8() -> None:
    from tilertc.backends.tilelang.emit import emit

    with pytest.raises(ScheduleError, match="FP8 weights are not yet in the TileLang backend"):
        emit(make_program(fp8("llama-tiny"), max_seq_len=SEQ))


# -- the passes -------------------------------------------------------------------------------
def test_fp8_rows_are_their_values_and_scales_padded() -> None:
    assert packed_row_bytes(2048, 128) == 2048 + 16 * 4  # 2112, already a multiple of 16
    assert packed_row_bytes(64, 128) == 80  # 64 + one scale (a partial block) -> 68 -> 80
    assert packed_row_bytes(8192, 128) == 8192 + 64 * 4


def expected_weight_bytes(spec: tilertc.ModelSpec, layout: str) -> int:
    """Bytes per token of a dense model's weight rows, from its shapes alone: `bf16`, FP8
    `rows` (each row its values, then a scale per 128 columns, padded to 16 bytes) or FP8
    `tiles` (a tile's rows, `ir/fp8.py: tile_rows`, share each 128-column block's scale:
    docs/artifact.md, "FP8 tiles")."""
    h, d, nh, nkv = spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads
    inter = spec.intermediate_size

    def rows(n: int, k: int) -> int:
        if layout == "tiles":
            return n * k + n // tile_rows(k) * 4 * (k // 128)
        return n * (-(-(k + 4 * math.ceil(k / 128)) // 16) * 16 if layout == "rows" else 2 * k)

    layer = rows((nh + 2 * nkv) * d, h) + rows(h, nh * d) + rows(2 * inter, h) + rows(h, inter)
    return spec.num_layers * layer + spec.vocab_size * h * 2  # lm_head stays bf16


@pytest.mark.parametrize("name", ["llama-3.2-1b", "qwen3-8b"])
def test_passes_count_fp8_bytes_before_and_after(name: str) -> None:
    bf16, q = make_program(load_spec(name)), make_program(fp8(name), tuning={"fp8_mma": False})
    assert bf16.weight_bytes == expected_weight_bytes(bf16.spec, "bf16")
    assert q.weight_bytes == expected_weight_bytes(q.spec, "rows")
    tiles = make_program(fp8(name), tuning={"fp8_mma": True})
    assert tiles.weight_bytes == expected_weight_bytes(q.spec, "tiles")
    qkv = {p.spec.weight_format.dtype: p.graph.op("layers.0.qkv_proj").attrs["tile"]
           for p in (bf16, q)}
    k = bf16.spec.hidden_size
    assert qkv["bf16"]["bytes_per_task"] == qkv["bf16"]["rows_per_task"][1] * 2 * k
    assert qkv["fp8_e4m3"]["bytes_per_task"] == qkv["fp8_e4m3"]["rows_per_task"][1] * \
        packed_row_bytes(k, 128)
    # the cost model and the roofline see the smaller stream; lm_head's rows do not change
    from tilertc.passes.cost import roofline_ns

    assert roofline_ns(q) < 0.7 * roofline_ns(bf16)
    lm = [(t.weight_bytes, t.rows) for p in (bf16, q) for t in p.tasks_of("lm_head")]
    assert lm[:len(lm) // 2] == lm[len(lm) // 2:]
    assert any("FP8 rows" in d for d in q.decisions)
    assert not any("FP8 rows" in d for d in bf16.decisions)


def test_task_table_names_each_tasks_weight_format() -> None:
    p = make_program(fp8("llama-tiny"), max_seq_len=SEQ)
    tasks, _, _ = encode(p)
    col = FIELDS.index("w_format")
    for t, row in zip(p.tasks, tasks, strict=True):
        if t.opcode in ("norm_matvec", "matvec_add"):
            want = "bf16" if t.op == "lm_head" else "fp8_e4m3"
            assert row[col] == WEIGHT_FORMATS[want], t.key
    consts = codegen.constants(p)
    assert (consts["WEIGHT_FP8"], consts["FP8_BLOCK_COLS"]) == (1, 128)
    bf16 = codegen.constants(make_program(load_spec("llama-tiny"), max_seq_len=SEQ))
    assert bf16["WEIGHT_FP8"] == 0 and "FP8_BLOCK_COLS" not in bf16


@pytest.mark.parametrize("name", [*DENSE_TINY, "qwen3-moe-tiny", "deepseek-v3-tiny",
                                  "deepseek-v3.2-tiny", "glm-5-tiny"])
def test_verifier_runs_fp8_tiny_models_against_the_interpreter(name: str) -> None:
    verify(make_program(fp8(name), max_seq_len=SEQ), "numeric")


@pytest.mark.parametrize("name", ["llama-3.2-1b", "qwen3-8b", "qwen3-30b-a3b"])
def test_full_size_fp8_schedules_are_sound(name: str) -> None:
    verify(make_program(fp8(name)), "structural")


# -- packing and the weight checks --------------------------------------------------------------
@pytest.fixture(scope="module")
def odd_fp8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    needs_nvcc()
    return compile(load_spec("llama-tiny-odd"), tmp_path_factory.mktemp("odd-fp8"),  # rows
                   CompileOptions(max_seq_len=SEQ, weight_dtype="fp8", fp8_mma=False))


def test_packed_fp8_rows_dequantize_to_the_interpreters_weights(odd_fp8: Path) -> None:
    """Walk every weight-streaming task row by row, decode its packed bytes independently of
    pack_rows (e4m3 values, fp32 scales, zero padding) and compare with the interpreter's
    dequantized weights. llama-tiny-odd: tasks of several rows, interleaved gate/up."""
    m = read_manifest(odd_fp8)
    graph = tilertc.build_graph(fp8("llama-tiny-odd"), SEQ)
    weights = random_weights(graph, seed=5)
    interp = Interpreter(graph, weights)
    by_hf = {t.hf_name: t.name for t in graph.weights()}
    packed = pack_weights(m["weights"], weights, torch.device("cpu"))
    tasks = np.load(odd_fp8 / "schedule.npz")["tasks"]
    f = {name: i for i, name in enumerate(FIELDS)}
    entries = {e["offset"]: e for e in m["weights"]["layout"]}
    formats = set()
    for t in tasks:
        if t[f["row_bytes"]] == 0:
            continue
        offset = ((int(t[f["w_hi"]]) << 32) | (int(t[f["w_lo"]]) & 0xFFFFFFFF)) * 16
        entry = entries[offset]
        formats.add(entry["format"])
        assert t[f["w_format"]] == WEIGHT_FORMATS[entry["format"]]
        rows = [(name, r) for name, r0, r1 in entry["segments"] for r in range(r0, r1)]
        if entry["interleave"]:  # gate row, up row, gate row, ...
            half = len(rows) // 2
            rows = [rows[i // 2 + (i % 2) * half] for i in range(2 * half)]
        per_row = int(t[f["row_bytes"]]) // (2 if entry["interleave"] else 1)
        assert len(rows) * per_row == (t[f["row1"]] - t[f["row0"]]) * t[f["row_bytes"]]
        for i, (name, r) in enumerate(rows):
            got = packed[offset + i * per_row: offset + (i + 1) * per_row]
            want = interp.weight(by_hf[name])[r].float()
            k = want.numel()
            if entry["format"] == "bf16":
                assert per_row == 2 * k
                assert torch.equal(got.view(torch.bfloat16).float(), want)
                continue
            n_scales = -(-k // 128)
            assert per_row == -(-(k + 4 * n_scales) // 16) * 16
            values = got[:k].view(torch.float8_e4m3fn).float()
            scales = torch.tensor(struct.unpack(f"<{n_scales}f", bytes(got[k:k + 4 * n_scales])))
            assert torch.equal(values * scales.repeat_interleave(128)[:k], want), (name, r)
            assert not got[k + 4 * n_scales:].any(), "padding must be zeros"
    assert formats == {"bf16", "fp8_e4m3"}  # lm_head (tied embeddings) stays bf16


def test_fp8_weight_checks_name_the_tensor(odd_fp8: Path) -> None:
    from tilertc.artifact import expected_weights

    expected = expected_weights(read_manifest(odd_fp8))
    w, s = "model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight_scale_inv"
    assert expected[w][1] == torch.float8_e4m3fn and expected[s][1] == torch.float32
    sd = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in expected.items()}
    check_weights(sd, expected)
    with pytest.raises(WeightMismatch, match=rf"'{s}' is missing"):
        check_weights({k: v for k, v in sd.items() if k != s}, expected)
    with pytest.raises(WeightMismatch, match=rf"'{s}' has shape \[1, 2\], the artifact needs"):
        check_weights({**sd, s: torch.zeros(1, 2)}, expected)
    with pytest.raises(WeightMismatch, match=rf"'{s}' is torch.bfloat16, the artifact needs "
                                             "torch.float32"):
        check_weights({**sd, s: sd[s].bfloat16()}, expected)
    with pytest.raises(WeightMismatch, match=rf"'{w}' is torch.bfloat16, the artifact needs "
                                             "torch.float8_e4m3fn"):  # scales, but no e4m3
        check_weights({**sd, w: sd[w].bfloat16()}, expected)


def test_bf16_checkpoints_are_quantized_at_load_and_fp8_ones_kept() -> None:
    graph = tilertc.build_graph(fp8("llama-tiny"), SEQ)
    bf16 = random_weights(tilertc.build_graph(load_spec("llama-tiny"), SEQ), seed=3)
    got = quantize_unscaled(graph, bf16)
    w = "model.layers.1.self_attn.o_proj.weight"
    q, s = quantize(bf16[w], (128, 128))
    assert torch.equal(got[w].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(got[w + "_scale_inv"], s)
    assert got["model.norm.weight"] is bf16["model.norm.weight"]  # not a projection
    checkpoint = random_weights(graph, seed=4)  # already e4m3 with scales: left as it is
    assert all(quantize_unscaled(graph, checkpoint)[k] is v for k, v in checkpoint.items())
    no_scale = {k: v for k, v in checkpoint.items() if k != w + "_scale_inv"}
    assert w + "_scale_inv" not in quantize_unscaled(graph, no_scale)  # for check_weights


@pytest.mark.parametrize("name", ["deepseek-v3.2-tiny", "glm-5-tiny"])
def test_fp8_mla_checkpoints_in_the_published_layout_are_what_the_artifact_takes(
        name: str) -> None:
    """The weights an FP8 DeepSeek-V3.2 / GLM-5 artifact takes, by checkpoint name: every
    linear layer's `*.weight` e4m3 with its fp32 `*.weight_scale_inv` (attention's, kv_b, the
    indexer's wq_b and wk, the dense MLP's, the shared and the routed experts'), and bf16 the
    norms, the router, the indexer's weights_proj, the embedding and lm_head. A bf16
    checkpoint quantized at load has exactly that layout."""
    from tilertc.artifact import weight_table

    graph = tilertc.build_graph(fp8(name), SEQ)
    table = weight_table(graph)
    e4m3 = {n for n, (_, dtype) in table.items() if dtype == torch.float8_e4m3fn}
    moe = "model.layers.1."
    assert {moe + p + ".weight" for p in (
        "self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa",
        "self_attn.kv_b_proj", "self_attn.o_proj", "self_attn.indexer.wq_b",
        "self_attn.indexer.wk", "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj",
        "mlp.shared_experts.down_proj", "mlp.experts.7.up_proj", "mlp.experts.0.down_proj",
    )} | {"model.layers.0.mlp.down_proj.weight"} <= e4m3
    scales = {n for n, (_, dtype) in table.items() if dtype == torch.float32}
    assert scales == {n + "_scale_inv" for n in e4m3} | {
        f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (1, 2)}
    for n in (moe + "self_attn.indexer.weights_proj.weight", moe + "mlp.gate.weight",
              moe + "self_attn.kv_a_layernorm.weight", "lm_head.weight",
              "model.embed_tokens.weight"):
        assert table[n][1] == torch.bfloat16, n
    bf16 = random_weights(tilertc.build_graph(load_spec(name), SEQ), seed=1)
    check_weights(quantize_unscaled(graph, bf16), table)


# -- the kernel's FP8 dot product, on the host --------------------------------------------------
HARNESS = Path(__file__).with_name("host_fp8_dot.cpp")


def fp8_source() -> str:
    """The device library's row loop (decode/dot.cuh: dot_groups) and its FP8 section: the
    block-size check, Fp8Row, dot_segment_fp8 and dot_segment_fp8_pieces (whose TP > 1 part is left
    out: TP is 0 here)."""
    src = codegen.library_source()
    loop = src.index("// The loop every row format shares")
    start = src.index("// FP8 rows (ir/fp8.py")
    pieces = src.index("__device__ float dot_segment_fp8_pieces", start)
    return (src[loop:src.index("// A bf16 row", loop)]
            + src[start:src.index("\n}\n", pieces) + 3])


def host_cuda_compiler() -> tuple[str, Path]:
    """g++ and the CUDA include directory (beside nvcc, or /usr/local/cuda's), for harnesses
    that convert e4m3 with cuda_fp8.h on the host; skips the test without them."""
    cxx = shutil.which("g++")
    include = [p for p in (Path(codegen.find_nvcc()).resolve().parents[1] / "include",
                           Path("/usr/local/cuda/include")) if (p / "cuda_fp8.h").is_file()]
    if cxx is None or not include:
        pytest.skip("needs g++ and the CUDA headers (cuda_fp8.h)")
    return cxx, include[0]


@pytest.fixture(scope="module")
def host_dot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cxx, include = host_cuda_compiler()
    out = tmp_path_factory.mktemp("host_fp8")
    (out / "fp8_extract.inc").write_text(fp8_source())
    exe = out / "host_fp8_dot"
    subprocess.run([cxx, "-O1", "-std=c++20", "-pthread", f"-I{out}", f"-I{include}",
                    "-DFP8_BLOCK_COLS=128", "-o", str(exe), str(HARNESS)],
                   check=True, capture_output=True, text=True)
    return exe


def fp8_row(k: int, gen: torch.Generator, cols: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """One e4m3 row of k columns with one scale per `cols` columns; blocks of very different
    magnitudes, and zeros, e4m3's largest value and subnormals among the values."""
    w = torch.randn(1, k, generator=gen) * torch.exp2(torch.randint(-12, 4, (1, k), generator=gen))
    w[0, :: 37] = 0.0
    q, s = quantize(w, (1, cols))
    q = q.view(torch.uint8)
    q[0, 5::53] = 0x7E  # 448
    q[0, 11::61] = 0x83  # a negative subnormal
    return q.view(torch.float8_e4m3fn), s


def run_dot(host_dot: Path, cases: list[tuple[int, int, int, int, int, int]], packed: bytes,
            x: np.ndarray) -> list[float]:
    """The harness's warp sums of `cases` (k, begin, end, slots, shared_k, scale_cols), all
    over one packed row and input."""
    stdin = b"".join(struct.pack("<6i", *c) + packed + x.tobytes() for c in cases)
    out = subprocess.run([str(host_dot)], input=stdin, capture_output=True, check=True).stdout
    return [float(np.uint32(int(line)).view(np.float32)) for line in out.decode().split()]


def assert_float64_math(got: list[float], segments: list[tuple[int, int]], w: np.ndarray,
                        x: np.ndarray) -> None:
    """Each segment's dot product (8-column groups [b, e)) to a few float32 ulps of its
    largest partial sums: float32 products and sums of e4m3 x fp32 scale, exact in float64."""
    for (b, e), y in zip(segments, got, strict=True):
        terms = w[8 * b:8 * e] * x[8 * b:8 * e].astype(np.float64)
        assert abs(y - terms.sum()) <= 1e-6 * np.abs(terms).sum() + 1e-30, (b, e, y, terms.sum())


def segments_of(k8: int, *extra: tuple[int, int]) -> list[tuple[int, int]]:
    cand = {(0, k8), (0, 1), (k8 - 1, k8), (3, max(4, k8 - 2)), (k8 // 3, 2 * k8 // 3),
            (5, min(k8, 5 + 16)), (7, min(k8, 7 + 64 + 5)), *extra}
    return sorted((b, e) for b, e in cand if 0 <= b < e <= k8)


@pytest.mark.parametrize(("k", "cols"), [(64, 128), (72, 128), (200, 128), (1024, 128),
                                         (2056, 128), (4096, 128), (192, 64), (24, 8),
                                         (128, 32), (520, 64)])
def test_kernel_fp8_dot_product_is_float64_math(host_dot: Path, k: int, cols: int) -> None:
    """One FP8 row with one scale per `cols` columns: 128 (a checkpoint weight's block), or
    fewer (MLA's q absorption rows: 64 for GLM-5, 8 for glm-5-tiny)."""
    gen = torch.Generator().manual_seed(k + cols)
    q, s = fp8_row(k, gen, cols)
    packed = pack_rows(q, row_scales(s, (1, cols))).numpy().tobytes()
    x = (torch.randn(k, generator=gen) * 3).numpy().astype(np.float32)
    segments = segments_of(k // 8)
    got = run_dot(host_dot, [(k, b, e, 1, 0, cols) for b, e in segments], packed, x)
    w = (q.double() * expand_blocks(s.double(), (1, k), (1, cols)))[0].numpy()
    assert_float64_math(got, segments, w, x)


@pytest.mark.parametrize("slots, k, shared", [(2, 64, 0), (8, 768, 0), (4, 200 * 4, 0),
                                               (2, 64 + 32, 32), (1, 32 + 64, 64),
                                               (8, 8 * 96 + 200, 200)])
def test_kernel_fp8_dot_over_a_routed_rows_pieces_is_float64_math(host_dot: Path, slots: int,
                                                                  k: int, shared: int) -> None:
    """A routed down row is one FP8 row per slot side by side, then (DeepSeek-V3) the shared
    expert's, each with its own scales; the shared one may be wider (several shared experts):
    the pieces' dot product over any segment of the whole row equals float64 math."""
    gen = torch.Generator().manual_seed(slots * k + shared)
    widths = [(k - shared) // slots] * slots + ([shared] if shared else [])
    rows = [fp8_row(n, gen) for n in widths]
    packed = b"".join(pack_rows(q, row_scales(s, (128, 128))[:1]).numpy().tobytes()
                      for q, s in rows)
    x = (torch.randn(k, generator=gen) * 3).numpy().astype(np.float32)
    w = np.concatenate([(q.double() * expand_blocks(s.double(), (1, n), (128, 128)))[0].numpy()
                        for (q, s), n in zip(rows, widths, strict=True)])
    k8, pk8 = k // 8, widths[0] // 8
    segments = segments_of(k8, (0, pk8), (pk8 - 1, pk8 + 1), (1, k8 - 1), (pk8, 2 * pk8),
                           (k8 - shared // 8 - 1, k8), (k8 - shared // 8, k8))
    got = run_dot(host_dot, [(k, b, e, slots, shared, 128) for b, e in segments], packed, x)
    assert_float64_math(got, segments, w, x)


# -- the command line ---------------------------------------------------------------------------
def test_compile_weight_dtype_fp8_writes_a_checked_artifact(tmp_path: Path) -> None:
    needs_nvcc()
    out = tmp_path / "llama-tiny-fp8"
    result = CliRunner().invoke(main, ["compile", "llama-tiny", "-o", str(out), "--max-seq-len",
                                       str(SEQ), "--weight-dtype", "fp8"])
    assert result.exit_code == 0, result.output
    m = check_artifact(out)
    tool = Path(__file__).parents[1] / "tools" / "check_artifact.py"
    assert subprocess.run([sys.executable, str(tool), str(out)]).returncode == 0
    assert m["options"]["weight_dtype"] == "fp8"
    assert m["model"]["spec"]["weight_format"]["dtype"] == "fp8_e4m3"
    assert m["kernel"]["constants"]["WEIGHT_FP8"] == 1
    assert "#define WEIGHT_FP8 1" in (out / "kernel.cu").read_text()
    fmt = {e["format"] for e in m["weights"]["layout"]}
    assert fmt == {"bf16", "fp8_e4m3"}
    refused = CliRunner().invoke(main, ["explain", "llama-tiny", "--weight-dtype", "fp8",
                                        "--tp", "2"])
    assert refused.exit_code != 0 and "FP8 weight 'model.layers.0" in refused.output
    explained = CliRunner().invoke(main, ["explain", "llama-tiny", "--weight-dtype", "fp8"])
    assert explained.exit_code == 0 and "FP8 rows" in explained.output
