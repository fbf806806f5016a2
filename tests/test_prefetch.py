"""The L2 prefetch pass (passes/prefetch.py): MLA q_b_proj and o_proj tasks that ask L2 for their
weight pages ahead of the ring, where the `l2_prefetch_pages` knob asks; and what the kernel
gets."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_fp8_kernel import needs_nvcc
from test_mla_kernel import WIDE, assert_step_matches, mla_tiny, random_host_step
from test_moe_kernel import TOOL, columns
from test_passes import until

import tilertc
from tilertc.backends.cuda import codegen
from tilertc.backends.cuda.encode import OPCODES, PREFETCH_FIELDS
from tilertc.driver import CompileOptions, compile
from tilertc.passes.pipeline import make_program
from tilertc.passes.prefetch import L2_SHARE, l2_prefetch
from tilertc.passes.program import ScheduleError


def prefetching(program) -> dict[str, int]:
    return {op.name: op.attrs["l2_pages"] for op in program.graph.ops() if "l2_pages" in op.attrs}


def test_off_by_default_and_on_mla_q_b_and_o_proj_only_when_asked() -> None:
    """Before / after: by default no op prefetches and the kernel has no prefetch field; with the
    knob, each layer's q_b_proj (after the input projection) and o_proj (the matvec_add of the v
    expansion's output), and nothing else."""
    spec = tilertc.load_spec("deepseek-v3.2-tiny")
    off = make_program(spec)
    assert prefetching(off) == {} and "L2_PREFETCH" not in codegen.constants(off)
    before, after = until("deepseek-v3.2-tiny", l2_prefetch, tuning={"l2_prefetch_pages": 2})
    assert prefetching(before) == {}
    assert prefetching(after) == {f"layers.{i}.{op}": 2 for i in range(spec.num_layers)
                                  for op in ("q_b_proj", "o_proj")}
    assert any(d.startswith("[prefetch]") and "pages 1-2" in d for d in after.decisions)
    assert codegen.constants(make_program(spec, tuning={"l2_prefetch_pages": 2}))[
        "L2_PREFETCH"] == 1


def test_the_prefetched_pages_take_at_most_their_share_of_l2() -> None:
    """Full-size DeepSeek-V3.2: 132 o_proj tasks a layer, a page each ~66 KB: 8 pages asked of
    every task would be ~70 MB, past the H200's 60 MiB; the pass keeps an op within half of
    L2."""
    spec = tilertc.load_spec("deepseek-v3.2", overrides={"num_hidden_layers": 2})
    program = make_program(spec, tuning={"l2_prefetch_pages": 8})
    pages = {n for name, n in prefetching(program).items() if name.endswith("o_proj")}
    tasks = len(program.tasks_of("layers.0.o_proj"))
    assert len(pages) == 1
    n = pages.pop()
    assert 0 < n < 8
    assert n * tasks * program.config["page_bytes"] <= program.target.l2_bytes // L2_SHARE
    assert (n + 1) * tasks * program.config["page_bytes"] > program.target.l2_bytes // L2_SHARE
    assert any(f"pages 1-{n} " in d and "8 pages asked" in d for d in program.decisions
               if d.startswith("[prefetch]"))


def test_without_a_q_lora_only_o_proj_prefetches() -> None:
    """Where q comes from the input projection itself (no q LoRA), that projection follows the
    previous layer's MoE or FFN, which streams: only o_proj prefetches."""
    spec = mla_tiny(**WIDE)
    program = make_program(spec, max_seq_len=512, tuning={"l2_prefetch_pages": 2})
    assert set(prefetching(program)) == {f"layers.{i}.o_proj" for i in range(spec.num_layers)}


@pytest.mark.parametrize(("name", "pages", "message"), [
    ("llama-tiny", 2, "no MLA attention"),
    ("deepseek-v3.2-tiny", -1, "at least 0")])
def test_what_it_cannot_do_is_refused_by_name(name: str, pages: int, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        make_program(tilertc.load_spec(name), tuning={"l2_prefetch_pages": pages})


def test_the_prefetching_kernel_compiles_and_its_table_says_which_tasks(tmp_path: Path) -> None:
    """deepseek-v3.2-tiny with the knob: one checked kernel without spills, the prefetch field
    last but the TP ones, set on q_b_proj's and o_proj's tasks only."""
    needs_nvcc()
    spec = tilertc.load_spec("deepseek-v3.2-tiny")
    out = compile(spec, tmp_path, CompileOptions(max_seq_len=512, l2_prefetch_pages=2))
    assert subprocess.run([sys.executable, str(TOOL), str(out)]).returncode == 0
    col, m = columns(out)
    assert m["task_fields"][-len(PREFETCH_FIELDS):] == list(PREFETCH_FIELDS)
    assert m["kernel"]["ptxas"].get("spill_stores", 0) == 0, m["kernel"]["ptxas"]
    assert "cp.async.bulk.prefetch.L2" in (out / "kernel.cu").read_text()
    prefetch = col["l2_pages"] > 0
    program = make_program(spec, max_seq_len=512)
    assert prefetch.sum() == spec.num_layers * sum(
        len(program.tasks_of(f"layers.0.{op}")) for op in ("q_b_proj", "o_proj"))
    assert set(col["opcode"][prefetch]) == {OPCODES["norm_matvec"], OPCODES["matvec_add"]}


def test_a_step_with_the_prefetch_field_on_the_host_is_the_interpreters(tmp_path: Path) -> None:
    """The prefetch only warms L2, so a step is the step without it: on the host (whose
    harness runs compute, not the loader) the table with the extra field still reads right."""
    spec = mla_tiny()
    program, token, bufs, env, _ = random_host_step(tmp_path, spec, "h200", 20,
                                                    {"l2_prefetch_pages": 2})
    assert prefetching(program)
    assert_step_matches(bufs, env, token, spec.num_layers, ("attn_out", "x.attn", "x.ffn"))


@pytest.fixture(scope="module", params=["deepseek-v3.2-tiny", "glm-5-tiny"])
def prefetch_engine(request, tmp_path_factory):
    from test_cuda_kernel import compiled_engine

    return compiled_engine(request.param, tmp_path_factory, l2_prefetch_pages=2)


@pytest.mark.gpu
def test_gpu_prefetching_kernel_logits_match_interpreter(prefetch_engine) -> None:
    """The loader's bulk prefetches (their addresses and sizes: a bad one faults) in the whole
    kernel, whose logits stay the interpreter's."""
    from test_cuda_kernel import check_teacher_forced

    assert prefetch_engine.m["kernel"]["constants"]["L2_PREFETCH"] == 1
    check_teacher_forced(prefetch_engine)
