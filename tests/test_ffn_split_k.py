"""The split-K FFN (`CompileOptions(ffn_split_k=True)`, passes/fusion.py: _fuse_split_k) on the
CPU: what fusion, tiling and packing make of a dense MLP with the option and without it, the
task table's fixed-point fields, what is refused by name, the verifier on the fused schedules
(and planted bugs in the start value and the adds), and a whole decode step of the kernel's
own device code (tests/host_kernel.cpp: `step`) against the interpreter.

On a GPU: tests/test_cuda_kernel.py (SPLIT_K_MODELS).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_fp8_kernel import needs_nvcc
from test_mla_kernel import assert_step_matches, random_host_step, small
from test_moe_kernel import TOOL

import tilertc
from tilertc.backends.cuda import codegen, encode
from tilertc.backends.cuda.encode import FFN_FIELDS, FIELDS
from tilertc.driver import CompileOptions, compile, manifest
from tilertc.engine import pack_weights
from tilertc.ir.weights import random_weights
from tilertc.passes.fusion import FIXED_FRAC_BITS
from tilertc.passes.pipeline import make_program
from tilertc.passes.program import Program, ScheduleError
from tilertc.passes.task_semantics import from_fixed, to_fixed
from tilertc.passes.verify import VerificationError, verify

SPLIT = {"ffn_split_k": True}


def scheduled(name: str = "llama-tiny", target: Any = "h200", split: bool = True,
              overrides: dict | None = None, tp: int = 1) -> Program:
    spec = tilertc.load_spec(name, overrides=overrides)
    return make_program(spec, target, tp, 48, SPLIT if split else {})


def split_ops(program: Program) -> list:
    return [op for op in program.graph.ops() if op.opcode == "ffn_split_k"]


# -- fusion, tiling, packing -------------------------------------------------------------------

def test_fusion_makes_each_dense_mlp_one_op_only_with_the_option() -> None:
    """Without the option (the default) a layer's MLP is gate/up then down; with it, one
    ffn_split_k op that reads x.attn and adds into a fixed-point x.ffn, whose start value
    o_proj writes; the next layer waits for the one op."""
    off, on = scheduled(split=False), scheduled()
    assert not split_ops(off) and not split_ops(scheduled("llama-tiny", split=False))
    assert {op.name: op.opcode for op in off.graph.ops() if "ffn" in op.name} == {
        "layers.0.ffn.gate_up_proj": "norm_matvec", "layers.0.ffn.down_proj": "matvec_add",
        "layers.1.ffn.gate_up_proj": "norm_matvec", "layers.1.ffn.down_proj": "matvec_add"}
    assert len(on.graph.ops()) == len(off.graph.ops()) - 2
    g = on.graph
    for layer in range(2):
        op = g.op(f"layers.{layer}.ffn.split_k")
        x, out = f"layers.{layer}.x.attn", f"layers.{layer}.x.ffn"
        assert op.inputs == (x, f"layers.{layer}.post_attention_layernorm",
                             *(f"layers.{layer}.mlp.{p}_proj" for p in ("gate", "up", "down")))
        assert op.outputs == (out,) and op.attrs["accumulate"]
        assert [o.rsplit(".", 1)[-1] for o in op.attrs["fused_from"]] == [
            "post_attn_norm", "gate_proj", "up_proj", "silu_mul", "down_proj", "ffn_residual"]
        assert g.tensors[out].dtype == "fx64" and g.tensors[out].attrs["frac_bits"] == 32
        assert off.graph.tensors[out].dtype == "fp32"
        o_proj = g.op(f"layers.{layer}.o_proj")
        assert o_proj.outputs == (x, out) and o_proj.attrs["start_value"] == out
        assert op.attrs["waits"] == [f"layers.{layer}.o_proj"]
    assert g.op("layers.1.qkv_proj").attrs["waits"] == ["layers.0.ffn.split_k"]
    assert any("16 ffn_split_k" in d for d in scheduled("llama-3.2-1b").decisions)


def test_tiling_cuts_the_intermediate_into_whole_pieces_one_slice_per_sm() -> None:
    """llama-3.2-1b: 8192 columns over 132 SMs in slices of 56 or 64 (whole groups of 8),
    each streaming its gate/up pairs and its columns of W_down; the step streams the same
    weight bytes as without the option."""
    on, off = scheduled("llama-3.2-1b"), scheduled("llama-3.2-1b", split=False)
    tasks = on.tasks_of("layers.0.ffn.split_k")
    assert len(tasks) == 132
    assert [t.rows[0] for t in tasks] == [0, *(t.rows[1] for t in tasks[:-1])]
    assert tasks[-1].rows[1] == 8192
    widths = {t.rows[1] - t.rows[0] for t in tasks}
    assert widths == {56, 64}
    for t in tasks:
        c0, c1 = t.rows
        assert [(s.tensor.rsplit(".", 1)[-1], s.row0, s.row1, s.cols) for s in t.segments] == [
            ("gate_proj", c0, c1, None), ("up_proj", c0, c1, None),
            ("down_proj", 0, 2048, (c0, c1))]
        assert t.weight_bytes == (c1 - c0) * 2 * 2048 * 2 + 2048 * (c1 - c0) * 2
    assert on.weight_bytes == off.weight_bytes
    assert on.config["acc_floats"] >= 2 * 64 and on.config["vec_floats"] >= 2048


def test_packed_weights_are_the_gate_up_pairs_then_the_down_columns() -> None:
    """Where the task table points, each split-K task's packed region holds its slice's gate
    and up rows interleaved, then W_down's columns of the slice, row by row."""
    program = make_program(tilertc.load_spec("llama-tiny"), small("h200-5", 5), 1, 64, SPLIT)
    m = manifest(program, CompileOptions(ffn_split_k=True), codegen.constants(program), {}, "")
    weights = random_weights(tilertc.build_graph(program.spec, 64), seed=3)
    packed = pack_weights(m["weights"], weights, torch.device("cpu"))
    cols = encode.fields(program)
    tasks = [t for t in program.tasks if t.opcode == "ffn_split_k"]
    assert {t.rows[1] - t.rows[0] for t in tasks} == {24, 32}
    for t in tasks:
        row = dict(zip(cols, encode.encode_task(program, t), strict=True))
        c0, c1 = t.rows
        w = {p: weights[f"model.layers.{t.op.split('.')[1]}.mlp.{p}_proj.weight"]
             for p in ("gate", "up", "down")}
        gate_up = torch.stack([w["gate"][c0:c1], w["up"][c0:c1]], 1).reshape(-1)
        down = w["down"][:, c0:c1].reshape(-1)
        at = row["w_lo"] * 16
        got = packed[at:at + t.weight_bytes].view(torch.bfloat16)
        assert torch.equal(got, torch.cat([gate_up, down])), t.key
        assert (row["row0"], row["row1"], row["k"], row["row_bytes"]) == (c0, c1, 64, 4 * 64)


def test_task_table_marks_fixed_point_inputs_and_the_start_value() -> None:
    """The table has the FFN fields only with the option; o_proj writes the start value at
    x.ffn's offset, and the next layer's norm prologue and residual, and the final norm, read
    x.ffn as fixed point. x.ffn takes two words per element of the arena."""
    assert encode.fields(scheduled(split=False)) == FIELDS
    program = scheduled()
    assert encode.fields(program) == (*FIELDS, *FFN_FIELDS)
    buf = program.buffers["layers.0.x.ffn"]
    assert buf.dtype == "fx64"
    assert all(b.offset >= buf.offset + 2 * buf.numel or b.offset + b.numel <= buf.offset
               for n, b in program.buffers.items() if b.arena == "act" and n != buf.name)
    cols = encode.fields(program)
    rows = {}
    for t in program.tasks:
        row = dict(zip(cols, encode.encode_task(program, t), strict=True))
        rows.setdefault(t.op, set()).add((row["fixed_in"], row["fixed_res"], row["fixed_out"]))
    x_ffn = [program.buffers[f"layers.{i}.x.ffn"].offset for i in range(2)]
    assert rows["layers.0.o_proj"] == {(0, 0, x_ffn[0])}
    assert rows["layers.1.o_proj"] == {(0, 1, x_ffn[1])}
    assert rows["layers.0.qkv_proj"] == {(0, 0, -1)}
    assert rows["layers.1.qkv_proj"] == rows["lm_head"] == {(1, 0, -1)}
    assert rows["layers.1.ffn.split_k"] == rows["layers.0.attention"] == {(0, 0, -1)}


def test_fixed_point_round_trip_and_order_independence() -> None:
    """to_fixed/from_fixed are the kernel's conversions: exact for values on the 2^-32 grid,
    and an integer sum of rounded parts does not depend on the order of the adds."""
    x = torch.tensor([1.5, -3.25, 2.0**-32, 12345.0])
    assert torch.equal(from_fixed(to_fixed(x, FIXED_FRAC_BITS), FIXED_FRAC_BITS), x)
    parts = torch.randn(132, 64, generator=torch.Generator().manual_seed(0)) * 40
    fixed = to_fixed(parts, FIXED_FRAC_BITS)
    assert torch.equal(fixed.sum(0), fixed.flip(0).sum(0))
    err = (from_fixed(fixed.sum(0), FIXED_FRAC_BITS) - parts.double().sum(0)).abs()
    assert float(err.max()) <= 1e-4  # one fp32 rounding of a sum of magnitude ~1e3


# -- what is refused ---------------------------------------------------------------------------

@pytest.mark.parametrize(("how", "message"), [
    ({"overrides": {"intermediate_size": 124}}, "intermediate size 124 is not a multiple of 8"),
    ({"tp": 2}, "ffn_split_k runs at --tp 1 only, not --tp 2"),
])
def test_uncovered_shapes_are_refused_by_name(how: dict, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        scheduled("llama-tiny", **how)


def test_fp8_weights_and_the_tilelang_backend_refuse_it_by_name() -> None:
    from tilertc.backends.tilelang.emit import emit
    from tilertc.model_specs.hf import with_weight_dtype

    spec = with_weight_dtype(tilertc.load_spec("llama-tiny"), "fp8")
    with pytest.raises(ScheduleError, match="'layers.0.ffn.split_k': ffn_split_k is not yet "
                                            "supported with FP8 weights"):
        make_program(spec, "h200", 1, 48, SPLIT)
    with pytest.raises(ScheduleError, match="'layers.0.ffn.split_k': the split-K FFN "
                                            r"\(ffn_split_k\) is not yet in the TileLang"):
        emit(scheduled())


def test_tuning_knob_parses_as_a_flag() -> None:
    from tilertc.bench import parse_tuning

    assert parse_tuning(("ffn_split_k=1", "page_kb=32")) == (("ffn_split_k", True),
                                                             ("page_kb", 32))
    with pytest.raises(ValueError, match="ffn_split_k is a flag"):
        parse_tuning(("ffn_split_k=2",))


# -- the verifier --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-tiny"])
def test_split_k_schedules_match_the_interpreter_in_every_interleaving(name: str) -> None:
    """The adds land in random orders; the fixed-point sums (and so the logits) are the same
    in every interleaving, and the interpreter's to 1e-4."""
    report = verify(scheduled(name), "numeric", steps=2, interleavings=3)
    assert len(report.logits) == 2


@pytest.mark.parametrize("name", ["llama-3.2-1b", "qwen3-0.6b"])
def test_full_size_split_k_schedules_are_sound(name: str) -> None:
    verify(make_program(tilertc.load_spec(name), tuning=SPLIT), "structural")


@pytest.mark.parametrize("mode", ["numeric", "structural"])
def test_reading_the_sum_before_the_adds_is_a_read_before_write(mode: str) -> None:
    program = scheduled()
    victim = next(t for t in program.tasks if t.op == "layers.1.qkv_proj")
    victim.waits = []
    with pytest.raises(VerificationError) as err:
        verify(program, mode, steps=2, interleavings=2)
    assert err.value.kind == "read_before_write"
    assert "layers.1.qkv_proj" in str(err.value) and "layers.0.x.ffn" in str(err.value)


def test_reading_the_sum_after_some_adds_only_is_a_read_before_write() -> None:
    """A reader that waits for all but one of the split-K tasks misses one add."""
    program = scheduled()
    counter = next(i for i, c in enumerate(program.counters) if c.name == "layers.0.ffn.split_k")
    for t in program.tasks:
        if t.op == "layers.1.qkv_proj":
            t.waits = [(counter, program.counters[counter].per_step - 1, 0)]
    with pytest.raises(VerificationError, match="layers.0.ffn.split_k#") as err:
        verify(program, "structural")
    assert err.value.kind == "read_before_write"


def test_adds_without_a_start_value_are_refused() -> None:
    program = scheduled()
    program.graph.op("layers.0.o_proj").attrs.pop("start_value")
    with pytest.raises(VerificationError, match=r"adds into layers.0.x.ffn\[0:64\] before its "
                                                "start value is written"):
        verify(program, "structural")


# -- the kernel ----------------------------------------------------------------------------------

def test_split_k_kernel_compiles_without_spills_and_only_with_the_option(tmp_path: Path) -> None:
    needs_nvcc()
    spec = tilertc.load_spec("llama-tiny")
    on = compile(spec, tmp_path / "on", CompileOptions(max_seq_len=64, ffn_split_k=True))
    off = compile(spec, tmp_path / "off", CompileOptions(max_seq_len=64))
    assert subprocess.run([sys.executable, str(TOOL), str(on)]).returncode == 0
    m, m_off = (json.loads((d / "manifest.json").read_text()) for d in (on, off))
    assert m["kernel"]["constants"]["FFN_SPLIT_K"] == 1
    assert "FFN_SPLIT_K" not in m_off["kernel"]["constants"]  # decode/task_table.cuh: 0 without it
    assert m["options"]["ffn_split_k"] is True and m["task_fields"] == [*FIELDS, *FFN_FIELDS]
    assert m["kernel"]["ptxas"].get("spill_stores", 0) == 0, m["kernel"]["ptxas"]
    assert m["kernel"]["ptxas"].get("stack_bytes", 0) == 0, m["kernel"]["ptxas"]
    assert (on / "kernel.cubin").read_bytes() != (off / "kernel.cubin").read_bytes()


def slice_widths(program: Program) -> set[int]:
    return {t.rows[1] - t.rows[0] for t in program.tasks if t.opcode == "ffn_split_k"}


# (model, overrides, target, the slice widths): one 8-column piece per slice (a lane per row,
# 32 rows per warp); 24/32 columns (4 lanes per row) with qk-norm; llama-tiny-odd (8 and 16,
# uneven slices, head_dim 64); 56 columns (7 pieces, 8 lanes, one idle); 384 columns on one SM
# (32 lanes, 1 or 2 pieces each, gate/up over two pages); DeepSeek-V3's MLA with dense FFNs.
STEPS = [
    ("llama-tiny", {}, "h200", {8}),
    ("qwen3-tiny", {}, small("h200-5", 5), {24, 32}),
    ("llama-tiny-odd", {}, "h200", {8, 16}),
    ("llama-tiny", {"intermediate_size": 112}, small("h200-2", 2), {56}),
    ("llama-tiny", {"intermediate_size": 384}, small("h200-1", 1), {384}),
    ("deepseek-v3-tiny", {"first_k_dense_replace": 3}, "h200", {8}),
]


@pytest.mark.parametrize(("name", "overrides", "target", "widths"), STEPS)
def test_kernel_step_on_the_host_is_the_interpreters(tmp_path: Path, name: str,
                                                     overrides: dict, target: Any,
                                                     widths: set[int]) -> None:
    """One decode step of the device library's own code with split-K FFNs (the loader's load_split_k
    filling the ring, o_proj writing the start value, run_split_k adding its slice's part, the
    next layer and the final norm reading the fixed-point sum) against the interpreter on
    random weights and tokens: per layer the attention output, x.attn and x.ffn, the logits and
    the token."""
    spec = tilertc.load_spec(name, overrides=overrides)
    program, token, bufs, env, _ = random_host_step(tmp_path, spec, target, 20, SPLIT)
    assert slice_widths(program) == widths and split_ops(program)
    assert_step_matches(bufs, env, token, spec.num_layers, ("attn_out", "x.attn", "x.ffn"))
