"""FP8 rows on the tensor cores (`--tune fp8_mma=1`, decode.cuh: split_vector, mma_tile,
mma_pages): what the option compiles and refuses, and a whole decode step of the kernel's own
device code (tests/host_kernel.cpp: `step`, its mma.m16n8k16 emulated from the PTX ISA's
fragment layout) against the interpreter, with a negative control (the k permutation broken
in B, which must fail). On a GPU: the real tensor cores, teacher-forced against the
interpreter (the gpu-marked tests at the end).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import test_mla_kernel
from test_fp8_kernel import needs_nvcc
from test_mla_kernel import assert_step_matches, random_host_step, small

import tilertc
from tilertc.backends.cuda import codegen, encode
from tilertc.driver import CompileOptions, compile
from tilertc.model_specs.hf import with_weight_dtype
from tilertc.passes.pipeline import make_program
from tilertc.passes.program import Program, ScheduleError

MMA = {"fp8_mma": True}
ELIGIBLE = {"norm_matvec", "matvec_add", "moe_gate_up"}
# dims whose projections are whole 128-column scale blocks (the tiny specs' hidden size, 64,
# is not, so their rows would all stay on the CUDA-core path)
WIDE = {"hidden_size": 256, "intermediate_size": 384, "head_dim": 64}


def mma_tasks(program: Program) -> set[tuple[str, int]]:
    """(opcode, halves) of the tasks the kernel runs on the tensor cores (decode.cuh:
    mma_rows): FP8 rows of an eligible opcode over whole scale blocks."""
    names = encode.fields(program)
    col = {n: i for i, n in enumerate(names)}
    opcode = {v: k for k, v in encode.OPCODES.items()}
    out = set()
    for row in encode.encode(program)[0]:
        op = opcode[int(row[col["opcode"]])]
        if (op in ELIGIBLE and int(row[col["w_format"]]) == encode.WEIGHT_FORMATS["fp8_e4m3"]
                and int(row[col["k"]]) % 128 == 0):
            out.add((op, 2 if int(row[col["epilogue"]]) == encode.EPILOGUES["silu_mul"] else 1))
    return out


def fp8_spec(name: str, overrides: dict[str, Any]) -> tilertc.ModelSpec:
    return with_weight_dtype(tilertc.load_spec(name, overrides=overrides), "fp8")


def test_the_knob_is_compiled_in_only_where_asked_for() -> None:
    spec = fp8_spec("llama-tiny", WIDE)
    on = codegen.constants(make_program(spec, tuning=MMA))
    off = codegen.constants(make_program(spec))
    assert on["FP8_MMA"] == 1 and "FP8_MMA" not in off


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


# (spec, overrides, target, tasks on the tensor cores): the dense spec on the H200 (one tile per
# page, few rows: the blocks cut into segments over the warps), on 3 SMs (pages of several
# tiles, partial tiles), and Qwen3-MoE's routed gate/up (8 rows' halves per tile)
STEPS = [
    ("llama-tiny", WIDE, "h200", {("norm_matvec", 1), ("norm_matvec", 2), ("matvec_add", 1)}),
    ("llama-tiny", WIDE, small("h200-3", 3),
     {("norm_matvec", 1), ("norm_matvec", 2), ("matvec_add", 1)}),
    ("qwen3-moe-tiny", {"hidden_size": 256, "head_dim": 64}, small("h200-5", 5),
     {("norm_matvec", 1), ("matvec_add", 1), ("moe_gate_up", 2)}),
]


@pytest.mark.parametrize(("name", "overrides", "target", "covers"), STEPS)
def test_kernel_step_on_the_host_is_the_interpreters(tmp_path: Path, name: str, overrides: dict,
                                                     target: Any, covers: set) -> None:
    """One decode step of decode.cuh's own code with fp8_mma (stage_vector's largest |x|,
    split_vector's f16 pair, mma_pages' tiles and segments) against the interpreter on random
    FP8 weights and tokens: per layer the attention output and the residual stream, the logits
    and the token."""
    spec = fp8_spec(name, overrides)
    program, token, bufs, env, _ = random_host_step(tmp_path, spec, target, 20, MMA)
    assert mma_tasks(program) >= covers
    assert_step_matches(bufs, env, token, spec.num_layers, ("attn_out", "x.attn", "x.ffn"))


def test_a_broken_k_permutation_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control: B's two registers swapped (x at the columns of the other half of
    mma m's k) gives wrong row sums, which the step test catches."""
    source = test_mla_kernel.step_source
    good = "mma_f16_16816(d, a, xs[2 * m], xs[2 * m + 1]);"
    bad = "mma_f16_16816(d, a, xs[2 * m + 1], xs[2 * m]);"
    assert good in source()
    monkeypatch.setattr(test_mla_kernel, "step_source", lambda: source().replace(good, bad))
    spec = fp8_spec("llama-tiny", WIDE)
    program, token, bufs, env, _ = random_host_step(tmp_path, spec, "h200", 20, MMA)
    with pytest.raises(AssertionError, match="max difference"):
        assert_step_matches(bufs, env, token, spec.num_layers, ("attn_out", "x.attn", "x.ffn"))


# -- on a GPU ----------------------------------------------------------------------------------
# dense models whose projections are whole scale blocks: every FP8 row of theirs but lm_head's
# (bf16) runs on the tensor cores
GPU_MODELS = ["llama-3.2-1b", "qwen3-1.7b", "llama-tiny-odd"]


@pytest.fixture(scope="module", params=GPU_MODELS)
def mma_engine(request, tmp_path_factory):
    from test_cuda_kernel import compiled_engine

    return compiled_engine(request.param, tmp_path_factory, weight_dtype="fp8", fp8_mma=True)


@pytest.mark.gpu
def test_gpu_teacher_forced_logits_match_interpreter(mma_engine) -> None:
    """The real mma.sync (fragment layout, f16 conversion, accumulation) in the whole kernel:
    the logits step by step within the FP8 tests' tolerances of the interpreter's."""
    from test_cuda_kernel import check_teacher_forced

    assert mma_engine.m["kernel"]["constants"]["FP8_MMA"] == 1
    check_teacher_forced(mma_engine)


@pytest.mark.gpu
def test_gpu_token_loop_equals_single_steps(mma_engine) -> None:
    from test_cuda_kernel import test_token_loop_equals_single_steps

    test_token_loop_equals_single_steps(mma_engine)
