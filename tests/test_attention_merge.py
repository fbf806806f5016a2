"""GQA attention's chunk merge (passes/tiling.py: `merge_chunks`; decode/attention.cuh:
run_attention).

The last chunk task of a KV group merges every chunk's partial softmax result. It stages them in
shared memory `merge_chunks` at a time, so that the chunk count follows the SMs rather than what
fits in a third of shared memory: Qwen3-30B-A3B (4 KV heads, 8 query heads of 128 dims each)
gets 32 chunks per group instead of 17.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from test_fp8_kernel import needs_nvcc
from test_mla_kernel import assert_step_matches, random_host_step

import tilertc
from tilertc.driver import CompileOptions, compile
from tilertc.ir.target import get_target
from tilertc.passes import tiling
from tilertc.passes.pipeline import make_program
from tilertc.passes.program import ScheduleError


def attention_tile(name: str, tuning: dict | None = None) -> dict:
    program = make_program(tilertc.load_spec(name), "h200", max_seq_len=1152, tuning=tuning)
    return program.graph.op("layers.0.attention").attrs["tile"]


@pytest.mark.parametrize(("name", "chunks", "merge_chunks"), [
    ("qwen3-30b-a3b", 32, 17),  # before: 17 chunks, all staged at once
    ("llama-3.2-1b", 16, 16),  # 132 SMs over 8 groups; every chunk staged at once, as before
    ("llama-3.1-8b", 16, 16),
])
def test_chunks_follow_the_sms_and_the_merge_stages_what_fits(name: str, chunks: int,
                                                              merge_chunks: int) -> None:
    tile = attention_tile(name)
    assert (tile["chunks"], tile["merge_chunks"]) == (chunks, merge_chunks)


def test_attn_chunks_knob_caps_the_chunks() -> None:
    """`--tune attn_chunks=N` caps the chunks per KV group, and per MLA head group (to try
    fewer); 16 chunks of Qwen3-30B-A3B's results fit one merge batch. Fewer than one is
    refused by name."""
    assert attention_tile("qwen3-30b-a3b", {"attn_chunks": 16})["chunks"] == 16
    assert attention_tile("qwen3-30b-a3b", {"attn_chunks": 16})["merge_chunks"] == 16
    assert attention_tile("llama-3.2-1b", {"attn_chunks": 64})["chunks"] == 16  # 132 SMs // 8
    with pytest.raises(ScheduleError, match="attn_chunks=0"):
        attention_tile("qwen3-30b-a3b", {"attn_chunks": 0})
    mla = make_program(tilertc.load_spec("deepseek-v3-tiny"), "h200", max_seq_len=256,
                       tuning={"attn_chunks": 4})
    assert mla.graph.op("layers.0.attention").attrs["tile"]["chunks"] == 4


@pytest.mark.parametrize(("room", "prefill", "sms", "chunks", "heads"), [
    (4, 20, 132, 32, 4), (4, 100, 132, 32, 4),
    (2, 200, 8, 4, 4),  # 50 keys per chunk: every one of the 4 compute warps holds some
    (4, 100, 132, 32, 6),  # 3 query heads a KV head: chunk results of 102 floats
])
def test_merge_in_batches_on_the_host_is_the_interpreters(tmp_path: Path, monkeypatch, room: int,
                                                          prefill: int, sms: int, chunks: int,
                                                          heads: int) -> None:
    """the device library's own step on the host with the merge given room for `room` chunk results
    (its own and room - 1 staged): with 3 staged, 32 chunks merge in 11 batches, the last of 2,
    and at a 20-token prompt 11 chunks are empty; with 1 staged, the 4 compute warps sum their
    partial results in 2 rounds over 2 slots (WARP_SLOTS), on a GPU of 8 SMs so that every warp
    has keys of its chunk. With 3 query heads a KV head a chunk result is 3 x (32 + 2) = 102
    floats, so most batches start off the 16-byte boundaries that the merge's asynchronous
    copies need (the host harness's copy aborts on an unaligned address, as the GPU's faults):
    the merge copies from the boundary below and reads the batch where its first result
    landed."""
    spec = dataclasses.replace(tilertc.load_spec("qwen3-tiny"), num_heads=heads)
    group = spec.num_heads // spec.num_kv_heads
    part_bytes = group * (spec.head_dim + 2) * 4
    target = dataclasses.replace(get_target("h200"), num_sms=sms)
    monkeypatch.setattr(tiling, "MERGE_SMEM_SHARE", target.smem_per_block // (room * part_bytes))
    program, token, bufs, env, _ = random_host_step(tmp_path, spec, target, prefill)
    tile = program.graph.op("layers.0.attention").attrs["tile"]
    assert (tile["chunks"], tile["merge_chunks"]) == (chunks, room - 1)
    assert program.config["compute_warps"] == 4
    assert_step_matches(bufs, env, token, spec.num_layers, ("attn_out", "x.attn", "x.ffn"))


def test_eight_query_heads_a_kv_head_on_the_host_is_the_interpreters(tmp_path: Path) -> None:
    """8 query heads a KV head (Qwen3-32B, Qwen3-30B-A3B; the tiny models have 2): the device
    library's own step on the host equals the interpreter, keys split over 4 warps and several
    chunks."""
    spec = dataclasses.replace(tilertc.load_spec("qwen3-tiny"), num_heads=16)
    assert spec.num_heads // spec.num_kv_heads == 8
    target = dataclasses.replace(get_target("h200"), num_sms=8)
    program, token, bufs, env, _ = random_host_step(tmp_path, spec, target, 100)
    assert program.graph.op("layers.0.attention").attrs["tile"]["chunks"] > 1
    assert_step_matches(bufs, env, token, spec.num_layers, ("attn_out", "x.attn", "x.ffn"))


def test_the_readme_model_compiles_without_spills(tmp_path: Path) -> None:
    """llama-3.2-1b as the README's main job compiles it: the merge's loops start from an opaque
    thread index, so that their first addresses are not held (and spilled) through the kernel
    (12 B spilled before, docs/performance.md, session 44)."""
    needs_nvcc()
    out = compile(tilertc.load_spec("llama-3.2-1b"), tmp_path, CompileOptions())
    ptxas = json.loads((out / "manifest.json").read_text())["kernel"]["ptxas"]
    assert ptxas.get("spill_stores", 0) == 0 and ptxas.get("stack_bytes", 0) == 0, ptxas
