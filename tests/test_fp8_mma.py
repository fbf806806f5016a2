"""FP8 tiles on the tensor cores (on where they fit unless the cost model predicts rows faster,
`--tune fp8_mma=1` asks for them, as these tests do;
passes/tiling.py: _fp8_tiles_fit, ir/fp8.py: pack_tiles, decode/tile_digits.cuh: stage_digits,
tile_pages): which tasks are tiled and what the knob refuses, the tile layout against the definition
it implements, and a whole decode step of the kernel's own device code (tests/host_kernel.cpp:
`step`, its wgmma emulated from the PTX ISA's operand and accumulator layouts) against the
interpreter, with negative controls (the digit factors off by one digit, the units' scales
swapped between segments). On a GPU: the real tensor cores, teacher-forced against the
interpreter (the gpu-marked tests at the end).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import test_mla_kernel
import torch
from test_cuda_kernel import VARIANTS
from test_fp8_kernel import needs_nvcc
from test_mla_kernel import DIGITS_REL, assert_step_matches, random_host_step, small

import tilertc
from tilertc.backends.cuda import codegen, encode
from tilertc.driver import CompileOptions, compile
from tilertc.ir.fp8 import pack_tiles, tile_rows, tile_segments, tile_unit_bytes, tile_unit_cols
from tilertc.model_specs.hf import with_weight_dtype
from tilertc.passes.pipeline import make_program
from tilertc.passes.program import Program, ScheduleError
from tilertc.passes.tiling import has_tiles, is_tiled, stream_row_bytes, tile_weights

MMA = {"fp8_mma": True, "ready_digits": False}
ROWS = {"fp8_mma": False}
# dims whose projections tile (K a multiple of 8 x 128: hidden, the heads' width and the
# intermediate size), with 4 heads of 256 (o_proj's K = 1024) and a 3072-wide MLP (down's
# segments of 384 columns: 3 units of 128 per tile)
WIDE = {"hidden_size": 1024, "intermediate_size": 3072, "head_dim": 256}
# the same with K = 1536 (hidden and intermediate): qkv, gate/up and down as tiles of 16 rows x
# 4 segments (o_proj's K = 1024: 8 x 8)
WIDE4 = {"hidden_size": 1536, "intermediate_size": 1536, "head_dim": 256}


def tiled_tasks(program: Program) -> set[tuple[str, int, int]]:
    """(opcode, halves, segments) of the tasks the kernel runs on the tensor cores (w_format
    fp8_e4m3_tiles); a MoE down task's segments are those of a piece (`tile_weights`)."""
    names = encode.fields(program)
    col = {n: i for i, n in enumerate(names)}
    opcode = {v: k for k, v in encode.OPCODES.items()}
    return {(opcode[int(row[col["opcode"]])],
             2 if int(row[col["epilogue"]]) == encode.EPILOGUES["silu_mul"] else 1,
             tile_segments(tile_weights(program.graph.op(t.op))[0]))
            for t, row in zip(program.tasks, encode.encode(program)[0], strict=True)
            if int(row[col["w_format"]]) == encode.WEIGHT_FORMATS["fp8_e4m3_tiles"]}


def fp8_spec(name: str, overrides: dict[str, Any]) -> tilertc.ModelSpec:
    return with_weight_dtype(tilertc.load_spec(name, overrides=overrides), "fp8")


def test_tiles_are_compiled_in_where_the_schedule_has_them() -> None:
    """In with the knob at 1, out with it at 0, and never in a bf16 kernel; by default in
    exactly when the schedule tiles (the cost model's choice, tests/test_passes.py)."""
    spec = fp8_spec("llama-tiny", WIDE)
    on = codegen.constants(make_program(spec, tuning={"fp8_mma": True}))
    off = codegen.constants(make_program(spec, tuning=ROWS))
    bf16 = codegen.constants(make_program(tilertc.load_spec("llama-tiny", overrides=WIDE)))
    assert on["FP8_MMA"] == 1 and "FP8_MMA" not in off and "FP8_MMA" not in bf16
    default = make_program(spec)
    assert codegen.constants(default).get("FP8_MMA") == (1 if has_tiles(default) else None)


@pytest.mark.parametrize(("weight_dtype", "tp", "message"), [
    ("bf16", 1, "weights are bf16"),
    ("fp8", 2, "--tp 1 only"),
])
def test_what_it_cannot_run_is_refused_by_name(weight_dtype: str, tp: int, message: str) -> None:
    spec = with_weight_dtype(tilertc.load_spec("llama-3.2-1b"), weight_dtype)
    with pytest.raises(ScheduleError, match="fp8_mma") as err:
        codegen.constants(make_program(spec, tp=tp, tuning=MMA))
    assert message in str(err.value)


def test_tilelang_backend_refuses_it(tmp_path: Path) -> None:
    with pytest.raises(ScheduleError, match="fp8_mma.*CUDA backend only"):
        compile(fp8_spec("llama-tiny", WIDE), tmp_path,
                CompileOptions(backend="tilelang", fp8_mma=True))


def test_it_compiles_without_spills(tmp_path: Path) -> None:
    needs_nvcc()
    out = compile(fp8_spec("llama-tiny", WIDE), tmp_path, CompileOptions(fp8_mma=True))
    kernel = json.loads((out / "manifest.json").read_text())["kernel"]
    assert kernel["constants"]["FP8_MMA"] == 1
    assert kernel["ptxas"]["spill_stores"] == 0 and kernel["ptxas"]["stack_bytes"] == 0


def test_tiles_are_whole_and_only_where_they_fit() -> None:
    """Every tiled task is whole tiles of 8 rows; a projection whose K does not cut into
    segments of whole 128-column blocks (qwen3-moe-tiny's routed down projection: K = 32)
    keeps its rows, and so does every task without the knob."""
    spec = fp8_spec("qwen3-moe-tiny", {"hidden_size": 1024, "head_dim": 256})
    program = make_program(spec, tuning=MMA)
    tiled = [t for t in program.tasks if is_tiled(program, program.graph.op(t.op))]
    assert {t.opcode for t in tiled} == {"norm_matvec", "matvec_add", "moe_gate_up"}
    assert all(r % tile_rows(1024) == 0 for t in tiled for r in t.rows)
    # no dense MLP; the routed gate/up (K = 1024) tiles, its down does not
    assert tiled_tasks(program) == {("norm_matvec", 1, 8), ("matvec_add", 1, 8),
                                    ("moe_gate_up", 2, 8)}
    assert not tiled_tasks(make_program(spec, tuning=ROWS))


@pytest.mark.parametrize("name", ["llama-3.1-8b", "deepseek-v3.2"])
def test_pages_hold_whole_units_and_the_vector_holds_the_digits(name: str) -> None:
    """Residency with tiles: a ring page holds whole units of every tiled op, less than a
    kilobyte (the 1024-byte rounding) and a unit's worth of scales short of full, and the
    staged vector has room for 4 digit bytes per column and a factor per 128 columns."""
    spec = tilertc.load_spec(name)
    if not spec.weight_format.is_fp8:
        spec = with_weight_dtype(spec, "fp8")
    program = make_program(spec, tuning=MMA)
    page, vec = program.config["page_bytes"], program.config["vec_floats"]
    tiled = [op for op in program.graph.ops() if is_tiled(program, op)]
    moe = ["moe_gate_up", "moe_down_add"] if spec.moe else []
    assert {op.opcode for op in tiled} == {"norm_matvec", "matvec_add", *moe}
    for op in tiled:
        unit, k = stream_row_bytes(program, op), op.attrs["K"]
        assert unit == tile_unit_bytes(tile_weights(op)[0]) and page % unit < 1024 + 128
        assert vec >= k + k // 128


def test_a_units_bytes_tell_its_columns_as_the_kernel_reads_them() -> None:
    """The kernel takes a unit's columns C off its row bytes by a threshold, not a division
    (decode/shared.cuh: unit_shift, C = 256 above 64 x 256 bytes, else 128) and S off k
    (tile_shift): every width that tiles must keep C and S to those two values each."""
    for k in range(512, 65536 + 1, 512):
        cols, segments = tile_unit_cols(k), tile_segments(k)
        assert cols in (128, 256) and segments in (4, 8)
        assert (tile_unit_bytes(k) > 64 * 256) == (cols == 256), k
        assert (k % 1024 == 0) == (segments == 8), k


@pytest.mark.parametrize(("k", "segments", "cols", "parts"), [(4096, 8, 256, 2), (1536, 4, 128, 3)])
def test_pack_tiles_places_every_value_and_scale_where_the_kernel_reads_it(
        k: int, segments: int, cols: int, parts: int) -> None:
    """Before: 2 tiles of rows (R = 64 / S of them) of k e4m3 values and their per-block
    scales. After: each tile's units (C columns of each of its S segments), the value of row r,
    column j k / S + p C + c at (c / 32) 2048 + (c % 32 / 16) 1024 + (R j + r) 16 + c % 16 of
    unit p of its tile, then the unit's scales, segment j's block b at j C / 128 + b."""
    gen = torch.Generator().manual_seed(7)
    rows = tile_rows(k)
    n, seg = 2 * rows, k // segments
    values = (torch.randn(n, k, generator=gen) * 50).to(torch.float8_e4m3fn)
    scales = torch.rand(2, k // 128, generator=gen).repeat_interleave(rows, 0)
    unit = tile_unit_bytes(k)
    assert rows * segments == 64 and tile_unit_cols(k) == cols
    assert unit == 64 * cols + 4 * segments * cols // 128
    packed = pack_tiles(values, scales).reshape(2, parts, unit)
    raw = values.view(torch.uint8)
    for tile in range(2):
        for part in range(parts):
            got = packed[tile, part]
            for r in range(rows):
                for j in range(segments):
                    for c in range(r + j, cols, 37):
                        m = rows * j + r
                        at = (c // 32) * 2048 + (c % 32 // 16) * 1024 + m * 16 + c % 16
                        assert got[at] == raw[rows * tile + r, j * seg + part * cols + c]
            want = scales[rows * tile].reshape(segments, parts, cols // 128)[:, part]
            got_scales = got[64 * cols:].clone().view(torch.float32).reshape(segments, -1)
            assert torch.equal(got_scales, want)


PARTS = ("attn_out", "x.attn", "x.ffn")
DENSE = {("norm_matvec", 1, 8), ("norm_matvec", 2, 8), ("matvec_add", 1, 8)}
DENSE4 = {("norm_matvec", 1, 4), ("norm_matvec", 2, 4), ("matvec_add", 1, 4), ("matvec_add", 1, 8)}
# (spec, overrides, target, tasks on the tensor cores): the dense spec on the H200 (tasks of
# a few tiles) and on 48 SMs (tasks of more: a gate/up task's 16 units on 2 pages, a down
# task's 2 or 3 tiles of 3 units)
STEPS = [
    ("llama-tiny", WIDE, "h200", DENSE),
    ("llama-tiny", WIDE, small("h200-48", 48), DENSE),
    ("llama-tiny", WIDE4, small("h200-48", 48), DENSE4),
]


@pytest.mark.parametrize(("name", "overrides", "target", "covers"), STEPS)
def test_kernel_step_on_the_host_is_the_interpreters(tmp_path: Path, name: str, overrides: dict,
                                                     target: Any, covers: set) -> None:
    """One decode step of the device library's own code with fp8_mma (stage_digits' digits and
    factors, tile_pages' units, folds and row sums) against the interpreter on random FP8
    weights and tokens: per layer the attention output and the residual stream, the logits
    and the token."""
    spec = fp8_spec(name, overrides)
    program, token, bufs, env, _ = random_host_step(tmp_path, spec, target, 20, MMA)
    assert tiled_tasks(program) >= covers
    assert_step_matches(bufs, env, token, spec.num_layers, PARTS, DIGITS_REL)


# DeepSeek-V3-tiny with slots (and its shared expert) of 512 or 1024 columns: the routed down
# projection as tiles, each tile's pieces from its slots' experts and the shared expert (tiles of
# 16 rows x 4 segments on the H200; of 8 x 8 on 5 SMs, tasks of two tiles over two pages); with
# a hidden size of 1024 the routed gate/up too (a slot's expert's gate and up tiles in turn)
MOE_STEPS = [({"moe_intermediate_size": 512}, "h200", {("moe_down_add", 1, 4)}),
             ({"moe_intermediate_size": 1024}, small("h200-5", 5), {("moe_down_add", 1, 8)}),
             ({"hidden_size": 1024, "moe_intermediate_size": 1024}, "h200",
              {("moe_gate_up", 2, 8), ("moe_down_add", 1, 8)})]


@pytest.mark.parametrize(("overrides", "target", "covers"), MOE_STEPS)
def test_moe_tiles_on_the_host_are_the_interpreters(tmp_path: Path, overrides: dict,
                                                    target: Any, covers: set) -> None:
    """One decode step as above with the routed experts on the tensor cores (the loader
    gathering a down task's units with copy_pieces, stage_digits' per-piece digits, tile_pages'
    pieces; a gate/up task's expert's tiles) against the interpreter: the routes exactly, every
    layer's residual stream, the logits."""
    from test_deepseek_moe_kernel import assert_routes_match

    spec = fp8_spec("deepseek-v3-tiny", overrides)
    program, token, bufs, env, _ = random_host_step(tmp_path, spec, target, 20, MMA)
    assert tiled_tasks(program) >= covers
    assert assert_routes_match(program, bufs, env) == [1, 2]
    assert_step_matches(bufs, env, token, spec.num_layers, ("x.attn", "x.ffn"), DIGITS_REL)


@pytest.mark.parametrize(("name", "overrides", "target"), [
    ("llama-tiny", WIDE, small("h200-48", 48)),
    ("deepseek-v3-tiny", {"moe_intermediate_size": 1024}, small("h200-5", 5))])
def test_warpgroups_sum_the_tiles_in_order_on_the_host(tmp_path: Path, name: str,
                                                       overrides: dict, target: Any) -> None:
    """The steps above with 8 compute warps: two warpgroups share a page's units, so a tile's
    units go to both, each adds its warps' sums into its own row sums (tile_sums) and the task
    adds those up at its end; against the interpreter."""
    spec = fp8_spec(name, overrides)
    program, token, bufs, env, _ = random_host_step(tmp_path, spec, target, 20,
                                                    {**MMA, "compute_warps": 8})
    assert program.config["compute_warps"] == 8
    assert_step_matches(bufs, env, token, spec.num_layers, ("x.attn", "x.ffn"), DIGITS_REL)


# Ready digits (passes/digits.py) hold each value to 2^-12 of its block's largest |x| (a group's
# exponent rounded up to a digit, up to 3 bits; the digits moved down to the block's, the
# lowest dropped), against stage_digits' 2^-16: 16x its tolerance.
READY = {**MMA, "ready_digits": True}
READY_REL = 16 * DIGITS_REL


# (spec, overrides, target, consumers per layer): llama-tiny's qkv, gate/up and down read ready
# digits but the first layer's qkv (the embedding makes its input), 8 x 8 tiles and 16 x 4 ones
# (on 48 SMs: tasks of whole chunks); deepseek-v3-tiny with dense FFNs (MLA attention) its
# gate/up's and attn_in_proj's (its o_proj does not tile here)
READY_STEPS = [("llama-tiny", WIDE, "h200", 3), ("llama-tiny", WIDE4, small("h200-48", 48), 3),
               (*VARIANTS["deepseek-v3-tiny-dense-wide"], "h200", 2)]


@pytest.mark.parametrize(("name", "overrides", "target", "per_layer"), READY_STEPS)
def test_ready_digits_on_the_host_are_the_interpreters(tmp_path: Path, name: str,
                                                      overrides: dict, target: Any,
                                                      per_layer: int) -> None:
    """One decode step with ready digits: the projections write their rows as the next tile
    task's digits (put_ready_digits), which it aligns and reads (stage_ready_digits), against
    the interpreter."""
    spec = fp8_spec(name, overrides)
    program, token, bufs, env, _ = random_host_step(tmp_path, spec, target, 20, READY)
    ready = [op.name for op in program.graph.ops() if op.attrs.get("ready_digits")]
    assert len(ready) == per_layer * spec.num_layers - 1
    assert_step_matches(bufs, env, token, spec.num_layers, ("x.attn", "x.ffn"), READY_REL)


# deepseek-v3-tiny with MoE layers whose o_proj (8 heads of 64 value dims), shared expert and
# routed experts (hidden 1024) all tile
TILED_MOE = VARIANTS["deepseek-v3-tiny-tiled-o-proj"][1]


def test_moe_gate_ups_share_o_proj_digits_on_the_host(tmp_path: Path) -> None:
    """A MoE layer's shared and routed gate/up both read its o_proj's output, normed alike:
    o_proj's tasks write one buffer of digits (named after the first reader) that both copy
    in; a MoE down's tasks write the next layer's attention input as its digits. Against the
    interpreter (routing included: the step's tokens and every layer's output)."""
    spec = fp8_spec("deepseek-v3-tiny", TILED_MOE)
    program, token, bufs, env, _ = random_host_step(tmp_path, spec, "h200", 20, READY)
    for layer in (1, 2):
        shared = f"layers.{layer}.ffn.shared_experts.gate_up_proj"
        for reader in (shared, f"layers.{layer}.moe.gate_up"):
            assert program.graph.op(reader).attrs["ready_digits"] == shared
        assert program.graph.op(f"layers.{layer}.o_proj").attrs["digits_for"] == shared
    assert program.graph.op("layers.1.moe.down_proj").attrs["digits_for"] == "layers.2.attn_in_proj"
    assert [b for b in program.buffers if b.endswith(".digits")] == [
        "layers.0.ffn.gate_up_proj.digits", "layers.1.ffn.shared_experts.gate_up_proj.digits",
        "layers.2.attn_in_proj.digits", "layers.2.ffn.shared_experts.gate_up_proj.digits"]
    assert_step_matches(bufs, env, token, spec.num_layers, ("x.attn", "x.ffn"), READY_REL)


@pytest.mark.parametrize("target", ["h200", small("h200-48", 48)])
def test_v_expansion_writes_o_proj_digits_on_the_host(tmp_path: Path, target: Any) -> None:
    """vexp_digits: MLA's v expansion (a head_matvec) writes o_proj's input as its digits, its
    tasks whole groups of 8 rows (on the H200 one group a task, every 16-column chunk shared
    with a neighbour and written a byte at a time; on 48 SMs 8 or 16 rows, whole chunks too),
    and o_proj copies them in. Against the interpreter."""
    spec = fp8_spec("deepseek-v3-tiny", TILED_MOE)
    program, token, bufs, env, _ = random_host_step(tmp_path, spec, target, 20,
                                                    {**READY, "vexp_digits": True})
    for layer in range(spec.num_layers):
        o_proj = f"layers.{layer}.o_proj"
        assert program.graph.op(f"layers.{layer}.v_expand").attrs["digits_for"] == o_proj
        assert program.graph.op(o_proj).attrs["ready_digits"] == o_proj
    assert all(t.rows[0] % 8 == 0 and t.rows[1] % 8 == 0
               for t in program.tasks_of("layers.0.v_expand"))
    assert_step_matches(bufs, env, token, spec.num_layers, ("attn_out", "x.attn", "x.ffn"),
                        READY_REL)


def test_vexp_digits_need_mla_with_o_proj_tiles() -> None:
    with pytest.raises(ScheduleError, match="vexp_digits.*o_proj as FP8 tiles"):
        make_program(fp8_spec("llama-tiny", WIDE), tuning={"vexp_digits": True})
    with pytest.raises(ScheduleError, match="vexp_digits"):
        make_program(fp8_spec("deepseek-v3-tiny", TILED_MOE),
                     tuning={"vexp_digits": True, "ready_digits": False})


@pytest.mark.parametrize(("name", "overrides", "target"),
                         [step[:3] for step in READY_STEPS[::2]])
def test_ready_digits_read_only_what_the_step_writes(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch, name: str,
                                                     overrides: dict, target: Any) -> None:
    """The step as above with every activation and scratch buffer of the act arena (the digit
    buffers among them; not the RoPE table) holding random values beforehand, as a launch finds
    what the previous step left: still the interpreter's, so no consumer reads digits,
    exponents or sums that its producer did not write in this step."""
    arena, filled = test_mla_kernel.act_arena, []

    def stale_arena(m: dict[str, Any], weights: dict[str, torch.Tensor], device: torch.device
                    ) -> torch.Tensor:
        act = arena(m, weights, device)
        gen = torch.Generator().manual_seed(7)
        for buffer, b in m["buffers"].items():
            if (b["arena"] == "act" and b["kind"] in ("activation", "scratch")
                    and buffer != m["rope"]["buffer"]):  # (the RoPE table is the engine's)
                filled.append(buffer)
                words = b["numel"] * (2 if b["dtype"] == "fx64" else 1)
                act[b["offset"]:b["offset"] + words] = 3 * torch.randn(words, generator=gen)
        return act

    monkeypatch.setattr(test_mla_kernel, "act_arena", stale_arena)
    spec = fp8_spec(name, overrides)
    program, token, bufs, env, _ = random_host_step(tmp_path, spec, target, 20, READY)
    assert any(b.endswith(".digits") for b in filled)
    assert_step_matches(bufs, env, token, spec.num_layers, ("x.attn", "x.ffn"), READY_REL)


@pytest.mark.parametrize(("good", "bad", "tuning", "rel"), [
    # a digit's factor one digit off (2^-4 instead of 2^-8 for digits 2 and 3)
    ("q & 1 ? 0x1p-8f : 1.f", "q & 1 ? 0x1p-4f : 1.f", MMA, DIGITS_REL),
    # the block scales of the neighbouring segment
    ("scale[j * blocks + b]", "scale[(j ^ 1) * blocks + b]", MMA, DIGITS_REL),
    # ready digits: a group below its block's exponent moved one digit too few
    ("if (const int shift = top - q)", "if (const int shift = top - q - (top > q))", READY,
     READY_REL),
])
def test_a_broken_fold_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, good: str,
                             bad: str, tuning: dict, rel: float) -> None:
    """The negative controls: each breaks one piece of the fold or of its input, and the step
    test catches it."""
    source = test_mla_kernel.step_source
    assert good in source()
    monkeypatch.setattr(test_mla_kernel, "step_source", lambda: source().replace(good, bad))
    spec = fp8_spec("llama-tiny", WIDE)
    program, token, bufs, env, _ = random_host_step(tmp_path, spec, "h200", 20, tuning)
    with pytest.raises(AssertionError, match="max difference"):
        assert_step_matches(bufs, env, token, spec.num_layers, PARTS, rel)


# -- on a GPU ----------------------------------------------------------------------------------
# dense models whose projections tile (llama-tiny-k1536 both ways; llama-tiny-odd's do not: its
# rows stay on the CUDA cores), every FP8 projection but lm_head (bf16); a MoE model whose
# routed experts tile (deepseek-v3-tiny-tiled-moe)
GPU_MODELS = ["llama-3.2-1b", "qwen3-1.7b", "llama-tiny-odd", "llama-tiny-k1536",
              "deepseek-v3-tiny-tiled-moe"]


@pytest.fixture(scope="module", params=GPU_MODELS)
def mma_engine(request, tmp_path_factory):
    from test_cuda_kernel import compiled_engine

    return compiled_engine(request.param, tmp_path_factory, weight_dtype="fp8", fp8_mma=True,
                           ready_digits=False)


@pytest.mark.gpu
def test_gpu_teacher_forced_logits_match_interpreter(mma_engine) -> None:
    """The real wgmma (descriptors, operand and accumulator layouts, e4m3 products) in the
    whole kernel: the logits step by step within the FP8 tests' tolerances of the interpreter's."""
    from test_cuda_kernel import check_teacher_forced

    assert mma_engine.m["kernel"]["constants"]["FP8_MMA"] == 1
    check_teacher_forced(mma_engine)


@pytest.mark.gpu
def test_gpu_token_loop_equals_single_steps(mma_engine) -> None:
    from test_cuda_kernel import test_token_loop_equals_single_steps

    test_token_loop_equals_single_steps(mma_engine)


# ready digits (passes/digits.py): dense models with 8 x 8 tiles (and qk norms), 16 x 4 ones, MLA
# with dense FFNs, and MLA with tiled MoE layers (a MoE down writes the next layer's digits)
READY_GPU_MODELS = ["llama-3.2-1b", "qwen3-1.7b", "llama-tiny-k1536", "deepseek-v3-tiny-dense-wide",
                    "deepseek-v3-tiny-tiled-moe"]


@pytest.fixture(scope="module", params=READY_GPU_MODELS)
def ready_engine(request, tmp_path_factory):
    from test_cuda_kernel import compiled_engine

    return compiled_engine(request.param, tmp_path_factory, weight_dtype="fp8", fp8_mma=True,
                           ready_digits=True)


@pytest.mark.gpu
def test_gpu_ready_digits_teacher_forced_logits_match_interpreter(ready_engine) -> None:
    """The producers' digit stores (whole chunks a word a lane, shared chunks a byte at a time)
    and the consumers' alignment on the GPU: the logits step by step within the FP8 tests'
    tolerances of the interpreter's."""
    from test_cuda_kernel import check_teacher_forced

    assert ready_engine.m["kernel"]["constants"]["READY_DIGITS"] == 1
    check_teacher_forced(ready_engine)


@pytest.mark.gpu
def test_gpu_ready_digits_token_loop_equals_single_steps(ready_engine) -> None:
    """A launch of many steps against one launch a step: the same tokens, no tie allowed.
    Session 27 saw llama-3.2-1b's loop take the other token of a near tie (token 5) while the
    tile sums added in the order the warps came; they add in a fixed order now, so a step
    repeats to the bit (docs/performance.md, sessions 28-29)."""
    from test_cuda_kernel import test_token_loop_equals_single_steps

    test_token_loop_equals_single_steps(ready_engine, near_tie=0.0)


@pytest.fixture(scope="module")
def vexp_engine(tmp_path_factory):
    from test_cuda_kernel import compiled_engine

    return compiled_engine("deepseek-v3-tiny-tiled-o-proj", tmp_path_factory, weight_dtype="fp8",
                           fp8_mma=True, vexp_digits=True)


@pytest.mark.gpu
def test_gpu_vexp_digits_teacher_forced_logits_match_interpreter(vexp_engine) -> None:
    """The v expansion's digit stores (a head_matvec's epilogue, tasks of 8 rows: chunks shared
    with a neighbour, a byte at a time) read by o_proj on the GPU, within the ready digits'
    tolerance of the interpreter's logits."""
    from test_cuda_kernel import check_teacher_forced

    check_teacher_forced(vexp_engine)


@pytest.mark.gpu
def test_gpu_vexp_digits_token_loop_equals_single_steps(vexp_engine) -> None:
    from test_cuda_kernel import test_token_loop_equals_single_steps

    test_token_loop_equals_single_steps(vexp_engine, near_tie=0.0)
