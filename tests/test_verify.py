"""The schedule verifier: every built-in schedule passes it, and planted bugs are caught and named.

Numeric mode runs each tiny model's per-SM streams in random interleavings against the
interpreter; structural mode checks full-size schedules for deadlock and dependency coverage.
"""

from __future__ import annotations

import time

import pytest

from tilertc import load_spec, schedule
from tilertc.passes.program import Program
from tilertc.passes.verify import VerificationError, verify

DENSE_TINY = ["llama-tiny", "qwen3-tiny", "llama-tiny-odd"]
FAMILY_TINY = ["qwen3-moe-tiny", "deepseek-v3-tiny", "deepseek-v3.2-tiny", "glm-5-tiny"]
DENSE_FULL = ["llama-3.2-1b", "qwen3-0.6b", "qwen3-1.7b", "llama-3.1-8b", "qwen3-8b"]
# FP8 weights are scheduled at --tp 1 only: DeepSeek-V3.2 is scheduled as it ships (FP8) at tp 1,
# as its bf16 variant at tp 8.
BF16 = {"quantization_config": None}
FAMILY_FULL = [("deepseek-v3.2", 1), ("deepseek-v3.2", 8), ("glm-5", 1), ("glm-5", 8),
               ("qwen3-30b-a3b", 1), ("qwen3-30b-a3b", 8)]


def tiny(name: str = "llama-tiny") -> Program:
    return schedule(load_spec(name), max_seq_len=48)


@pytest.mark.parametrize("name", DENSE_TINY + FAMILY_TINY)
def test_tiny_models_match_the_interpreter_in_every_interleaving(name: str) -> None:
    report = verify(tiny(name), "numeric", steps=2, interleavings=2)
    assert report.mode == "numeric" and len(report.logits) == len(report.tokens) == 2
    assert all(t == int(lg.argmax()) for t, lg in zip(report.tokens, report.logits, strict=True))


@pytest.mark.parametrize(("name", "sms", "per_slot"), [
    ("qwen3-moe-tiny", 5, 2), ("deepseek-v3-tiny", 3, 1), ("qwen3-moe-tiny", 1, 1)])
def test_routed_gate_up_of_whole_slot_ranges_matches_the_interpreter(name: str, sms: int,
                                                                     per_slot: int) -> None:
    """With every slot busy a gate/up slot's rows go to #SMs // slots tasks (passes/tiling.py:
    routed_tasks_per_slot): several rows per task, and with fewer SMs than slots one task per
    slot, several on one SM; in every interleaving the logits are the interpreter's."""
    import dataclasses

    from tilertc.ir.target import get_target

    target = dataclasses.replace(get_target("h200"), name=f"h200-{sms}", num_sms=sms)
    program = schedule(load_spec(name), target, max_seq_len=48)
    gate_up = next(op for op in program.graph.ops() if op.opcode == "moe_gate_up")
    assert gate_up.attrs["tile"]["tasks_per_slot"] == per_slot
    verify(program, "numeric", steps=2, interleavings=2)


@pytest.mark.parametrize("name", DENSE_FULL)
def test_full_size_dense_schedules_are_sound(name: str) -> None:
    assert verify(schedule(load_spec(name)), "structural").mode == "structural"


@pytest.mark.parametrize(("name", "tp"), FAMILY_FULL)
def test_full_size_moe_mla_dsa_schedules_are_sound(name: str, tp: int) -> None:
    verify(schedule(load_spec(name, BF16 if tp > 1 else None), tp=tp), "structural")


def test_structural_verification_takes_seconds() -> None:
    program = schedule(load_spec("llama-3.1-8b"))
    start = time.perf_counter()
    verify(program, "structural")
    assert time.perf_counter() - start < 30


def _task(program: Program, op: str, index: int = 0):
    return next(t for t in program.tasks if t.op == op and t.index == index)


def _counter(program: Program, op: str) -> int:
    return next(i for i, c in enumerate(program.counters) if c.name == op)


@pytest.mark.parametrize("mode", ["numeric", "structural"])
def test_a_missing_wait_is_a_read_before_write_naming_task_and_buffer(mode: str) -> None:
    program = tiny()
    victim = _task(program, "layers.1.o_proj", 3)
    assert victim.waits, "o_proj waits for attention"
    victim.waits = []
    with pytest.raises(VerificationError) as err:
        verify(program, mode, steps=2, interleavings=2)
    assert err.value.kind == "read_before_write"
    assert "layers.1.o_proj#3" in str(err.value) and "layers.1.attn_out" in str(err.value)


@pytest.mark.parametrize("mode", ["numeric", "structural"])
def test_a_circular_wait_is_a_deadlock_with_its_cycle(mode: str) -> None:
    program = tiny()
    embed = _task(program, "embed")
    embed.waits = [(_counter(program, "sample"), 1, 0)]  # this step's token, not the last one
    with pytest.raises(VerificationError) as err:
        verify(program, mode, steps=2, interleavings=1)
    msg = str(err.value)
    assert err.value.kind == "deadlock" and "cycle of waits" in msg
    assert "embed#0" in msg and "'sample'" in msg and "sample#0 would signal it" in msg


def test_an_early_task_waiting_on_a_later_op_deadlocks() -> None:
    program = tiny()
    early = _task(program, "layers.0.qkv_proj", 5)
    later = _counter(program, "layers.1.ffn.down_proj")
    early.waits.append((later, program.counters[later].per_step, 0))
    with pytest.raises(VerificationError) as err:
        verify(program, "structural")
    msg = str(err.value)
    assert err.value.kind == "deadlock" and "layers.0.qkv_proj#5" in msg
    assert "'layers.1.ffn.down_proj'" in msg


def test_a_counter_signalled_fewer_times_than_waited_for_is_reported() -> None:
    program = tiny()
    program.counters[_counter(program, "layers.0.o_proj")].per_step += 1
    with pytest.raises(VerificationError) as err:
        verify(program, "structural")
    assert err.value.kind == "counter" and "'layers.0.o_proj'" in str(err.value)


def test_modes_and_their_limits() -> None:
    with pytest.raises(ValueError, match="unknown verification mode"):
        verify(tiny(), "exhaustive")
    with pytest.raises(ValueError, match="tp = 1"):
        verify(schedule(load_spec("llama-tiny"), tp=2), "numeric")
    assert verify(tiny(), "auto", steps=1, interleavings=1).mode == "numeric"
    assert verify(schedule(load_spec("llama-tiny"), tp=2), "auto").mode == "structural"


def test_every_fused_opcode_has_tile_semantics() -> None:
    from tilertc.passes.fusion import FUSED_OPCODES
    from tilertc.passes.task_semantics import KINDS

    assert set(FUSED_OPCODES) == set(KINDS)
