"""Absorbed MLA (DeepSeek-V3 attention) in the CUDA backend, on the CPU: what the codegen
accepts and refuses, the MLA artifacts (tiny and full-size attention compile without spills,
dense cubins do not carry MLA code), the derived kv_b weights packed where the task table
points (bf16, and FP8 with their derived scales), and a whole decode step of the kernel's own
device code, run on the host (tests/host_kernel.cpp: `step`) from the task table, the packed
weights and the arenas, against the interpreter, with bf16 and FP8 weights.

The kernel against the interpreter on a GPU is in tests/test_cuda_kernel.py (MLA_MODELS).
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from kernel_source import KernelSource
from test_fp8_kernel import needs_nvcc
from test_moe_kernel import TOOL, columns
from test_sampling import HARNESS

import tilertc
from tilertc.backends.cuda import codegen, encode
from tilertc.backends.cuda.encode import FIELDS, MLA_FIELDS, OPCODES
from tilertc.driver import CompileOptions, compile, manifest
from tilertc.engine import Engine, act_arena, copy_cache, pack_weights, rank_state, shard_weights
from tilertc.ir.interpreter import Interpreter
from tilertc.ir.mla import kv_b_per_head
from tilertc.ir.target import get_target
from tilertc.ir.weights import random_weights
from tilertc.model_specs.hf import with_weight_dtype
from tilertc.model_specs.spec import ModelSpec
from tilertc.passes.fusion import FIXED_FRAC_BITS
from tilertc.passes.pipeline import make_program
from tilertc.passes.program import Program, ScheduleError
from tilertc.passes.residency import MLA_KEYS, mla_block_bytes
from tilertc.passes.task_semantics import from_fixed

# deepseek-v3-tiny with a dense FFN in every layer: DeepSeek's MoE routing is not in the kernel
DENSE = {"first_k_dense_replace": 3}
# Full-size DeepSeek-V3 attention (from the V3.2 config without its indexer), three dense layers
FULL = {"model_type": "deepseek_v3", "num_hidden_layers": 3, "first_k_dense_replace": 3,
        "quantization_config": None}


def mla_tiny(**overrides: Any) -> ModelSpec:
    return tilertc.load_spec("deepseek-v3-tiny", overrides={**DENSE, **overrides})


# -- what the codegen takes ----------------------------------------------------------------------

def test_codegen_takes_mla_and_compiles_mla_code_only_for_it() -> None:
    mla = codegen.constants(tilertc.schedule(mla_tiny()))
    assert {k: v for k, v in mla.items() if k.startswith("MLA")} == {
        "MLA": 1, "MLA_RANK": 16, "MLA_ROPE": 8, "MLA_NOPE": 16, "MLA_HEADS": 4, "MLA_KEYS": 32,
        "MLA_ROPE_INTERLEAVED": 1}
    assert "HEAD_DIM" not in mla  # GQA attention is not compiled into an MLA kernel
    dense = codegen.constants(tilertc.schedule(tilertc.load_spec("llama-tiny")))
    assert dense["MLA"] == 0 and not any(k.startswith("MLA_") for k in dense)


def test_latent_rows_of_partial_pieces_are_refused_by_name() -> None:
    program = tilertc.schedule(mla_tiny())
    program.graph.op("layers.1.attention").attrs["kv_lora_rank"] = 12
    with pytest.raises(ScheduleError, match="op 'layers.1.attention': not yet in the CUDA "
                                            "backend: latent cache rows of 20 values"):
        codegen.check_supported(program)


def test_a_latent_rank_of_partial_mma_tiles_is_refused_by_name() -> None:
    program = tilertc.schedule(mla_tiny())
    attrs = program.graph.op("layers.0.attention").attrs
    attrs["kv_lora_rank"], attrs["qk_rope_head_dim"] = 12, 12  # rows of 24: whole pieces
    with pytest.raises(ScheduleError, match="op 'layers.0.attention': not yet in the CUDA "
                                            "backend: a latent rank of 12 "):
        codegen.check_supported(program)


def test_tilelang_backend_refuses_mla() -> None:
    from tilertc.backends.tilelang.emit import emit

    with pytest.raises(ScheduleError, match="'layers.0.q_absorb': MLA is not yet in the "
                                            "TileLang backend"):
        emit(tilertc.schedule(mla_tiny()))


# -- the artifacts -----------------------------------------------------------------------------

def test_mla_artifacts_compile_without_spills(tmp_path: Path) -> None:
    """The tiny spec and full-size DeepSeek-V3 attention compile into one checked kernel that
    spills no more than the dense kernels (none); their tables have the MLA fields."""
    needs_nvcc()
    for name, spec in (("tiny", mla_tiny()),
                       ("full", tilertc.load_spec("deepseek-v3.2", overrides=FULL))):
        out = compile(spec, tmp_path / name, CompileOptions(max_seq_len=512))
        assert subprocess.run([sys.executable, str(TOOL), str(out)]).returncode == 0
        col, m = columns(out)
        assert m["task_fields"] == [*FIELDS, *MLA_FIELDS]
        assert "#define MLA 1" in (out / "kernel.cu").read_text()
        assert m["kernel"]["ptxas"].get("spill_stores", 0) == 0, m["kernel"]["ptxas"]
        assert m["kernel"]["ptxas"].get("stack_bytes", 0) == 0, m["kernel"]["ptxas"]
        attn = col["opcode"] == OPCODES["mla_attention"]
        groups = spec.num_heads // m["kernel"]["constants"]["MLA_HEADS"]
        assert attn.sum() == 3 * groups * col["count"][attn][0]  # layers x groups x chunks
        assert (col["append"] == 1).sum() == 3  # one latent append per layer


@pytest.mark.parametrize("spec", [mla_tiny(), with_weight_dtype(mla_tiny(), "fp8"),
                                  with_weight_dtype(tilertc.load_spec("glm-5-tiny"), "fp8")],
                         ids=["bf16", "fp8", "glm-5-tiny-fp8"])
def test_derived_kv_b_rows_are_packed_where_the_tasks_read_them(spec: ModelSpec) -> None:
    """Every head_matvec task's packed rows are the rows of W_uk transposed per head (q
    absorption) or of W_uv (v expansion), cut from kv_b_proj: bf16 as they are; FP8 as e4m3
    values then one fp32 scale per `scale_cols` columns (the manifest's), which dequantize
    exactly to the interpreter's kv_b. glm-5-tiny: heads of 56 kv_b rows, so W_uk's rows cross
    kv_b's block rows within a head and carry one scale per 8 columns."""
    program = tilertc.schedule(spec)
    m = manifest(program, CompileOptions(), codegen.constants(program), {}, "")
    graph = tilertc.build_graph(program.spec, 64)
    weights = random_weights(graph, seed=5)
    interp = Interpreter(graph, weights)
    packed = pack_weights(m["weights"], weights, torch.device("cpu"))
    entries = {e["offset"]: e for e in m["weights"]["layout"]}
    seen, cols = 0, set()
    for op in (o for o in program.graph.ops() if o.opcode == "head_matvec"):
        a = op.attrs
        w_uk, w_uv = kv_b_per_head(interp.weight(f"layers.{op.layer}.self_attn.kv_b_proj"), a)
        rows = (w_uk.transpose(1, 2) if "kv_a" in a["io"] else w_uv).reshape(a["rows"], a["K"])
        for t in (t for t in program.tasks if t.op == op.name):
            row = encode.encode_task(program, t)
            at = row[FIELDS.index("w_lo")] * 16
            entry, n = entries[at], t.rows[1] - t.rows[0]
            if not spec.weight_format.is_fp8:
                got = packed[at: at + n * a["K"] * 2].view(torch.bfloat16).float()
            else:
                c, k = entry["scale_cols"], a["K"]
                raw = packed[at: at + n * entry["row_bytes"]].view(n, entry["row_bytes"])
                scales = raw[:, k:k + 4 * -(-k // c)].contiguous().view(torch.float32)
                got = (raw[:, :k].contiguous().view(torch.float8_e4m3fn).float()
                       * scales.repeat_interleave(c, 1)[:, :k])
                cols.add(c)
            assert torch.equal(got.reshape(-1), rows[t.rows[0]:t.rows[1]].reshape(-1)), (
                op.name, t.index)
            seen += 1
    mla = spec.mla  # layers x (absorption, expansion): one task per row, at most one per SM
    assert seen == spec.num_layers * sum(min(spec.num_heads * n, 132)
                                         for n in (mla.kv_lora_rank, mla.v_head_dim))
    if spec.weight_format.is_fp8:  # W_uk's rows: gcd(128, nope + v); W_uv's: the block's
        nope_v = spec.mla.qk_nope_head_dim + spec.mla.v_head_dim
        assert cols == {math.gcd(128, nope_v), 128} == ({8, 128} if nope_v == 56 else {32, 128})


def test_derived_kv_b_scales_dequantize_to_the_derived_weights() -> None:
    """At full-size shapes too (DeepSeek-V3: heads of 128 + 128 kv_b rows; GLM-5: 192 + 256,
    whose odd heads start halfway into a block row), the e4m3 values of a derived weight
    times its derived scales, one per `derived_scale_cols` columns, are exactly the derived
    dequantized kv_b."""
    from tilertc.ir.fp8 import dequantize, quantize
    from tilertc.ir.mla import derive_kv_b, derive_kv_b_scales, derived_scale_cols

    gen = torch.Generator().manual_seed(0)
    for heads, nope, v, rank, want in ((3, 128, 128, 512, 128), (3, 192, 256, 512, 64),
                                       (4, 24, 32, 16, 8)):
        a = {"n_heads": heads, "qk_nope_head_dim": nope, "v_head_dim": v, "kv_lora_rank": rank}
        w = torch.randn(heads * (nope + v), rank, generator=gen)
        w *= torch.exp2(torch.randint(-6, 6, (heads * (nope + v), 1), generator=gen))
        q, s = quantize(w, (128, 128))
        assert derived_scale_cols("w_uk_t", a, (128, 128)) == want
        for kind in ("w_uk_t", "w_uv"):
            cols = derived_scale_cols(kind, a, (128, 128))
            values = derive_kv_b(q.float(), kind, a)
            scales = derive_kv_b_scales(s, kind, a, (128, 128))
            assert scales.shape == (values.shape[0], -(-values.shape[1] // cols))
            got = values * scales.repeat_interleave(cols, 1)[:, :values.shape[1]]
            assert torch.equal(got, derive_kv_b(dequantize(q, s, (128, 128)), kind, a)), kind


# -- a decode step of the device code, run on the host ---------------------------------------

def step_source() -> str:
    """What the `step` command runs of the device library: the task table and parameters, the
    shared-memory struct, the task predicates and weights' address, the loader's routed-task
    addressing (MoE), the start of a ring page (over the harness's claim_page), GQA attention's
    key/value pages (its proxy fence has no host meaning), what the loader puts in an MLA
    attention task's page (fill_mla_page) and the loader of a split-K FFN task, and everything
    compute runs for a task (the sampling section through the split-K FFN
    section: matrix-vector tasks, the exchanges between ranks, embedding, sampler, MoE router,
    attention, split-K)."""
    k = KernelSource()
    kv_pages = k.between("// Attention streams the past keys", "#endif  // !MLA").replace(
        'asm volatile("fence.proxy.async.global;" ::: "memory");', "")
    return "\n".join([
        *k.prelude(),
        *(k.definition(f"__device__ __forceinline__ bool {f}(const int* t)")
          for f in ("has_weights", "normed", "adds_residual")),
        k.definition("__device__ __forceinline__ const uint8_t* task_weights("),
        k.line("__device__ __forceinline__ int rows_per_page"),
        k.line("__device__ __forceinline__ int row_halves"),
        "#if FP8_MMA", k.line("__device__ __forceinline__ int tile_shift"),
        k.line("__device__ __forceinline__ int tile_segments"),
        k.definition("__device__ __forceinline__ int tile_pieces"),
        k.definition("__device__ __forceinline__ int tile_k"),
        k.line("__device__ __forceinline__ int unit_shift"),
        k.line("__device__ __forceinline__ int unit_cols"),
        k.definition("__device__ __forceinline__ int tile_units"),
        k.definition("__device__ __forceinline__ int piece_units"), "#endif",
        k.definition("__device__ __forceinline__ int stream_rows"),
        k.line("static_assert(MAX_SEQ <= "),
        k.definition("__device__ __forceinline__ long long chunk_start("),
        k.line("constexpr int SIGNAL_THREAD"),
        k.between("#if MOE\n// A routed task's row", "// Waits until ring slot"),
        k.definition("__device__ __forceinline__ uint8_t* start_page("),
        f"#if !MLA\n{kv_pages}#endif",
        k.between("#if MLA\n// A latent cache row", "// The loader's page of an MLA attention task")
        + "#endif",
        "#if FFN_SPLIT_K", k.definition("__device__ bool load_rows("),
        k.definition("__device__ bool load_split_k("), "#endif",
        k.between("// ---- sampling", "// ---- compute warps"),
    ])


def build_step_harness(out: Path, consts: dict[str, object]) -> Path:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    (out / "kernel_extract.inc").write_text(step_source())
    exe = out / "host_kernel"
    subprocess.run([cxx, "-O1", "-std=c++17", f"-I{out}", "-DHOST_STEP=1",
                    *[f"-D{k}={v}" for k, v in consts.items()],
                    "-o", str(exe), str(HARNESS)], check=True, capture_output=True, text=True)
    return exe


def small(name: str, sms: int):
    """The H200 with fewer SMs: tasks of several rows (head_matvec tasks that span heads) and
    few context chunks (several blocks of keys per chunk)."""
    import dataclasses

    return dataclasses.replace(get_target("h200"), name=name, num_sms=sms)


SEQ = 256
WIDE = {"num_attention_heads": 32, "num_key_value_heads": 32, "q_lora_rank": None,
        "rope_interleave": False, "kv_lora_rank": 160}
# (weights, spec overrides, target, prompt length, what the step's tasks cover): the tiny spec
# on the H200 (one row per task, 32 chunks, some empty at this context); on 5 SMs (head_matvec
# tasks straddling heads, 2 blocks of keys per chunk); 32 heads in two groups, no q LoRA (q from
# the input norm's projection), RoPE not interleaved, a latent rank of 160 (2 latent dims per
# thread of 4 warps) on 7 SMs (tasks spanning 6 heads, 3 blocks of keys per chunk). With FP8
# weights: the tiny spec, and the wide one (kv_b of 8 block rows and 2 block columns, one
# partial); with a v_head_dim of 24 (heads of 40 kv_b rows: W_uk's rows cross a block row at
# 8-column steps, one scale per 8 columns) on 5 SMs.
STEPS = [
    ("bf16", {}, "h200", 20, {"heads_per_task": 1, "key_blocks": 1, "empty_chunks": True,
                              "groups": 1}, False),
    ("bf16", {}, small("h200-5", 5), 200, {"heads_per_task": 2, "key_blocks": 2,
                                            "empty_chunks": False, "groups": 1}, False),
    ("bf16", WIDE, small("h200-7", 7), 200, {"heads_per_task": 6, "key_blocks": 3,
                                             "empty_chunks": False, "groups": 2}, False),
    ("fp8", {}, "h200", 20, {"heads_per_task": 1, "key_blocks": 1, "empty_chunks": True,
                             "groups": 1}, False),
    ("fp8", WIDE, small("h200-7", 7), 200, {"heads_per_task": 6, "key_blocks": 3,
                                            "empty_chunks": False, "groups": 2}, False),
    ("fp8", {"num_attention_heads": 8, "num_key_value_heads": 8, "v_head_dim": 24},
     small("h200-5", 5), 100, {"heads_per_task": 3, "key_blocks": 1, "empty_chunks": False,
                               "groups": 1}, False),
    # FP8 head rows on the tensor cores, x as digits (decode/matvec.cuh: head_rows_fp8; heads of
    # at least 64 rows): v expansion rows of 512 in heads of 64, its blocks split in two where a
    # task has one m-tile; the wide spec's v expansion rows of 320 in heads of 64, tasks across
    # heads, the last scale block partial; q absorption rows of 32 in heads of 128 (scales per 64
    # of kv_b's rows, 2 heads a block) beside v expansion rows of 128 (heads of 32: CUDA cores)
    # on 5 SMs
    ("fp8", {"kv_lora_rank": 512, "v_head_dim": 64}, "h200", 20,
     {"heads_per_task": 2, "key_blocks": 1, "empty_chunks": True, "groups": 1}, True),
    ("fp8", {**WIDE, "kv_lora_rank": 320, "v_head_dim": 64}, small("h200-7", 7), 200,
     {"heads_per_task": 6, "key_blocks": 3, "empty_chunks": False, "groups": 2}, True),
    ("fp8", {"kv_lora_rank": 128, "qk_nope_head_dim": 32, "v_head_dim": 32}, small("h200-5", 5),
     100, {"heads_per_task": 2, "key_blocks": 1, "empty_chunks": False, "groups": 1}, True),
]


def test_a_ring_page_holds_an_mla_key_block() -> None:
    """MLA attention keeps every other block of MLA_KEYS cache rows in a blank ring page
    (decode/mla.cuh: mla_chunk) and the RoPE factors after it, so residency grows pages asked
    smaller than that: a latent rank of 320 and a rope part of 8 stage rows of 392 bf16 (384 +
    8), 25088 B a block, and 32 B of factors, past 4 and 16 KB pages; 64 KB pages hold it as
    they are; a model without MLA keeps 4 KB pages."""
    spec = mla_tiny(**{**WIDE, "kv_lora_rank": 320})
    pages = {kb: make_program(spec, "h200", 1, SEQ, {"page_kb": kb}) for kb in (4, 16, 64)}
    assert {kb: mla_block_bytes(p) for kb, p in pages.items()} == dict.fromkeys(pages, 25120)
    assert {kb: p.config["page_bytes"] for kb, p in pages.items()} == {4: 25600, 16: 25600,
                                                                        64: 65536}
    assert any("pages of at least 25120 B" in str(d) for d in pages[4].decisions)
    assert not any("pages of at least" in str(d) for d in pages[64].decisions)
    assert make_program(tilertc.load_spec("llama-tiny"), "h200", 1, SEQ,
                        {"page_kb": 4}).config["page_bytes"] == 4096


def coverage(program: Program, pos: int) -> dict[str, object]:
    """The most heads a head_matvec task's rows span, the most key blocks (MLA_KEYS) of an
    attention chunk, whether a chunk is empty, and the head groups, at position `pos`."""
    spans = max(-(-t.rows[1] // a["rows_per_head"]) - t.rows[0] // a["rows_per_head"]
                for t in program.tasks if t.opcode == "head_matvec"
                for a in [program.graph.op(t.op).attrs])
    attn = next(op for op in program.graph.ops() if op.opcode == "mla_attention").attrs
    chunks, n = attn["tile"]["chunks"], pos + 1
    keys = [n * (c + 1) // chunks - n * c // chunks for c in range(chunks)]
    return {"heads_per_task": spans, "key_blocks": -(-max(keys) // MLA_KEYS),
            "empty_chunks": min(keys) == 0,
            "groups": attn["n_heads"] // attn["tile"]["heads_per_task"]}


def random_host_step(tmp: Path, spec: ModelSpec, target: Any, prefill: int,
                     tuning: dict[str, Any] | None = None) -> tuple[
        Program, int, dict[str, torch.Tensor], dict[str, torch.Tensor], Any]:
    """`host_step` of `spec` scheduled for `target` with 4 compute warps (and `tuning`), on
    random weights, a random `prefill`-token prompt and a random next token (all seeded by
    `prefill`); returns the program too."""
    program = make_program(spec, target, max_seq_len=SEQ,
                           tuning={"compute_warps": 4, **(tuning or {})})
    weights = random_weights(tilertc.build_graph(spec, SEQ), seed=prefill)
    gen = torch.Generator().manual_seed(prefill)
    prompt = torch.randint(0, spec.vocab_size, (prefill,), generator=gen)
    token = int(torch.randint(0, spec.vocab_size, (1,), generator=gen))
    return program, *host_step(tmp, program, weights, prompt, token)


# The digits of an FP8 tile task's input, or of an FP8 head_matvec's (decode/matvec.cuh:
# head_rows_fp8), hold x to 2^-17 of its block's largest |x| (a 16-bit fixed point per block), so
# a row sum is off by up to ~1e-4 of its size where x's blocks are peaky; 5e-4 is the step test's
# tolerance there (the CUDA-core path's, 1e-4, is for float32 x).
DIGITS_REL = 5e-4


def head_rows_on_digits(program: Program) -> bool:
    """Whether an FP8 head_matvec task runs on the tensor cores with its x as digits: its rows and
    their scale blocks (the narrower of 4 << scale_shift and the row; the last may be partial)
    whole 32-column steps, at most 128 columns a block, and heads of at least 64 rows
    (decode/matvec.cuh: head_rows_on_mma)."""
    names = encode.fields(program)
    col = {n: i for i, n in enumerate(names)}
    if "scale_shift" not in col:
        return False
    for row in encode.encode(program)[0]:
        k, span = int(row[col["k"]]), min(4 << int(row[col["scale_shift"]]), int(row[col["k"]]))
        if (int(row[col["opcode"]]) == OPCODES["head_matvec"] and k % 32 == 0 and span % 32 == 0
                and span <= 128 and int(row[col["head_rows"]]) >= 64):
            return True
    return False


def assert_step_matches(bufs: dict[str, torch.Tensor], env: dict[str, torch.Tensor],
                        token: int, layers: int, parts: tuple[str, ...], rel: float = 1e-4) -> None:
    """A host step's per-layer activations `parts` (to `rel` of each one's largest value), its
    logits and its token against the interpreter's."""
    for layer in range(layers):
        for name in parts:
            key = f"layers.{layer}.{name}"
            want, tol = env[key][0], rel * float(env[key][0].abs().max())
            assert torch.allclose(bufs[key], want, rtol=rel, atol=tol), (
                f"{key}: max difference {float((bufs[key] - want).abs().max()):.3g}")
    logits = env["logits"][0]
    assert torch.allclose(bufs["logits"], logits, rtol=rel, atol=rel * float(logits.abs().max()))
    assert token == int(bufs["logits"].argmax())


def buffer_values(arena: torch.Tensor, b: dict[str, Any]) -> torch.Tensor:
    """A manifest buffer's values in its arena; a fixed-point (fx64) buffer's as fp32."""
    if b["dtype"] == "fx64":
        words = arena[b["offset"]:b["offset"] + 2 * b["numel"]].view(torch.int64)
        return from_fixed(words, FIXED_FRAC_BITS)
    return arena[b["offset"]:b["offset"] + b["numel"]]


def host_step(tmp: Path, program: Program, weights: dict[str, torch.Tensor], prompt: torch.Tensor,
              token: int) -> tuple[int, dict[str, torch.Tensor], dict[str, torch.Tensor], Any]:
    """The step at position len(prompt) done by the harness, after the interpreter prefilled
    `prompt` (its caches copied into the kernel's layout as the engine does); returns the
    kernel's token and buffers (by name, from its arenas), the interpreter's tensors of the
    step, and the manifest. Under tp > 1 every rank runs its shard (weights and caches cut as
    the engine cuts them) with the others' arenas as its peers'; the buffers are rank 0's but
    `logits`, every rank's vocabulary rows in rank order, and `ranks`, each rank's buffers;
    every rank must pick the same token."""
    cpu = torch.device("cpu")
    consts = codegen.constants(program)
    m = manifest(program, CompileOptions(max_seq_len=SEQ, tp=program.tp), consts, {}, "")
    ref = Interpreter(tilertc.build_graph(program.spec, SEQ), weights, cpu,
                      cache_dtype=torch.bfloat16)
    ref.run(prompt, torch.arange(len(prompt)))
    dirs = [tmp] if program.tp == 1 else [tmp / f"rank{r}" for r in range(program.tp)]
    for r, d in enumerate(dirs):
        d.mkdir(exist_ok=True)
        mine = shard_weights(m, weights, r)
        kv = torch.zeros(m["arenas"]["kv"], dtype=torch.bfloat16)
        copy_cache(m, rank_state(m, ref.state, r), torch.arange(len(prompt)), kv)
        act = act_arena(m, mine, cpu)
        act[m["buffers"]["logits"]["offset"]:][:m["buffers"]["logits"]["numel"]] = float("nan")
        (d / "act.bin").write_bytes(act.numpy().tobytes())
        (d / "kv.bin").write_bytes(kv.view(torch.int16).numpy().tobytes())
        (d / "weights.bin").write_bytes(pack_weights(m["weights"], mine, cpu).numpy().tobytes())
    (tmp / "embed.bin").write_bytes(weights[m["embedding"]].view(torch.int16).numpy().tobytes())
    (tmp / "tasks.bin").write_bytes(encode.encode(program)[0].tobytes())
    exe = build_step_harness(tmp, consts)
    rope = m["buffers"][m["rope"]["buffer"]]["offset"]
    out = subprocess.run([str(exe)], input=f"step {tmp} {token} {len(prompt)} {rope}\n",
                         capture_output=True, text=True, check=True).stdout.split()
    tokens, errors = out[0::2], out[1::2]
    assert errors == ["0"] * program.tp, f"the kernel recorded errors {errors}"
    assert len(set(tokens)) == 1, f"the ranks picked different tokens {tokens}"
    ranks = [rank_buffers(m, d) for d in dirs]
    bufs = {**ranks[0], "logits": torch.cat([b["logits"] for b in ranks]), "ranks": ranks}
    env = ref.run(torch.tensor([token]), torch.tensor([len(prompt)]))
    return int(tokens[0]), bufs, env, m


def rank_buffers(m: dict[str, Any], d: Path) -> dict[str, torch.Tensor]:
    """A rank's buffers by name, from the arenas the harness wrote back to `d`."""
    act = torch.from_numpy(np.fromfile(d / "act.bin", dtype=np.float32))
    kv = torch.from_numpy(np.fromfile(d / "kv.bin", dtype=np.int16)).view(torch.bfloat16)
    arena = {"act": act, "kv": kv}
    return {name: buffer_values(arena[b["arena"]], b) for name, b in m["buffers"].items()}


@pytest.mark.parametrize("dtype, overrides, target, prefill, covers, digits", STEPS)
def test_kernel_step_on_the_host_is_the_interpreters(tmp_path: Path, dtype: str, overrides: dict,
                                                     target: Any, prefill: int,
                                                     covers: dict[str, object],
                                                     digits: bool) -> None:
    """One decode step of the device library's own code (embed, the norm_matvec / head_matvec /
    mla_attention / matvec_add tasks of every layer, lm_head and the greedy sampler) from the
    task table, packed weights and arenas, against the interpreter (bf16 cache like the
    kernel's) on random weights (bf16, or FP8 with their block scales) and tokens: per layer
    the latent queries, the attention's latent output, the expanded heads and the residual
    stream, the appended cache row, and the logits and token."""
    spec = with_weight_dtype(mla_tiny(**overrides), dtype)
    program, got_tok, bufs, env, m = random_host_step(tmp_path, spec, target, prefill)
    assert coverage(program, prefill) == covers
    assert head_rows_on_digits(program) == digits
    assert_step_matches(bufs, env, got_tok, spec.num_layers,
                        ("q_latent", "o_latent", "attn_out", "x.attn", "x.ffn"),
                        DIGITS_REL if digits else 1e-4)
    width = m["kv_cache"]["width"]
    for layer in range(spec.num_layers):
        cache = f"layers.{layer}.kv_latent_cache"
        row = bufs[cache].view(-1, width)[prefill].float()
        want = env[cache][prefill].float()  # bf16: one rounding step apart at most
        assert torch.allclose(row, want, rtol=1e-2, atol=1e-3 * float(want.abs().max())), cache
        assert torch.equal(bufs[cache].view(-1, width)[:prefill].float(),
                           env[cache][:prefill].float()), "the prefilled rows changed"


def broken_host_step(tmp: Path, monkeypatch: pytest.MonkeyPatch, good: str, bad: str,
                     spec: ModelSpec, target: Any, prefill: int) -> tuple[
        Program, int, dict[str, torch.Tensor], dict[str, torch.Tensor], Any]:
    """`random_host_step` with the device library's text `good` (which must occur once) replaced by
    `bad` in what the harness compiles: the negative controls' step."""
    source = step_source()
    assert source.count(good) == 1
    monkeypatch.setattr(sys.modules[__name__], "step_source", lambda: source.replace(good, bad))
    return random_host_step(tmp, spec, target, prefill)


# The negative controls of the step test: fragment mappings of mla_chunk's mma broken one at a
# time (the device library's text replaced in what the harness compiles), and the queries' bf16 lo
# half left out of the scores (bf16 queries alone: ~8 significand bits), each of which must fail it.
SCORE_B = "const uint32_t b0 = bf16_pair(key + 16 * k), b1 = bf16_pair(key + 16 * k + 8);"
QUERY_LO = ("      mla_a_fragment(a, m.q() + MLA_M * MLA_ROW, MLA_ROW, 16 * k, lane);\n"
            "      mma_bf16_16816(d, a, b0, b1);\n")
BROKEN_MMA = {
    "score B halves swapped": (SCORE_B, SCORE_B.replace("b0 =", "b2 =").replace("b1 =", "b0 =")
                               .replace("b2 =", "b1 =")),
    "value B keys paired wrong": ("col[0] | static_cast<uint32_t>(col[MLA_ROW]) << 16",
                                  "col[0] | static_cast<uint32_t>(col[8 * MLA_ROW]) << 16"),
    "query lo half dropped": (QUERY_LO, ""),
}


@pytest.mark.parametrize("broken", BROKEN_MMA)
def test_a_broken_mla_mma_fails_the_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         broken: str) -> None:
    spec = mla_tiny()
    _, got_tok, bufs, env, _ = broken_host_step(tmp_path, monkeypatch, *BROKEN_MMA[broken], spec,
                                                small("h200-5", 5), 200)
    with pytest.raises(AssertionError, match="o_latent: max difference"):
        assert_step_matches(bufs, env, got_tok, spec.num_layers, ("o_latent",))


def test_short_rows_summed_over_half_their_lanes_fail_the_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control of dot_short_row (FP8 q absorption rows, k = qk_nope_head_dim):
    its last shuffle left out, so that a row's sum misses half its lanes' groups."""
    good = "for (int o = SHORT_ROW_LANES / 2; o > 0; o >>= 1)"
    spec = with_weight_dtype(mla_tiny(), "fp8")
    _, got_tok, bufs, env, _ = broken_host_step(tmp_path, monkeypatch, good,
                                                good.replace("o > 0", "o > 1"), spec,
                                                small("h200-5", 5), 100)
    with pytest.raises(AssertionError, match="q_latent: max difference"):
        assert_step_matches(bufs, env, got_tok, spec.num_layers, ("q_latent",))


# The negative controls of head_rows_fp8 (FP8 head rows on the tensor cores, x as digits): a row
# summed over every lane's columns (those of the head after its own too), and A's k halves swapped
# (a k32 step's words 0-3 and 4-7 of the rows against x's own), each of which must fail the step.
DIGIT_ROWS = "head_input.head(r + min(i, n - 1)) - first == q / 2 ? y[h] : 0.f"
BROKEN_HEAD_ROWS = {
    "every lane's columns summed": (DIGIT_ROWS, "y[h]"),
    "A's k halves swapped": ("const uint32_t a[4] = {w0[at], w1[at], w0[at + 4], w1[at + 4]};",
                             "const uint32_t a[4] = {w0[at + 4], w1[at + 4], w0[at], w1[at]};"),
}


@pytest.mark.parametrize("broken", BROKEN_HEAD_ROWS)
def test_broken_fp8_head_rows_fail_the_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            broken: str) -> None:
    spec = with_weight_dtype(mla_tiny(kv_lora_rank=128, qk_nope_head_dim=32, v_head_dim=32), "fp8")
    _, got_tok, bufs, env, _ = broken_host_step(tmp_path, monkeypatch, *BROKEN_HEAD_ROWS[broken],
                                                spec, small("h200-5", 5), 100)
    with pytest.raises(AssertionError, match="q_latent: max difference"):
        assert_step_matches(bufs, env, got_tok, spec.num_layers, ("q_latent",), DIGITS_REL)


# -- on a GPU ----------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_full_size_mla_attention_output_matches_interpreter(tmp_path: Path) -> None:
    """mla_chunk on the H200's tensor cores at full size (DeepSeek-V3 attention: 16 heads per
    task, rows of 576, latent rank 512) after a 2500-token prompt, so that every chunk has
    several blocks of MLA_KEYS keys, the last one partial: each layer's latent attention output
    step by step against the interpreter's (its cache in bf16, as the kernel keeps it) within
    1e-3 of its largest value; the teacher-forced logits tests allow 2e-2."""
    from test_cuda_kernel import forced_steps, load

    prefill = 2500
    out = compile(load("deepseek-v3-attention"), tmp_path, CompileOptions(max_seq_len=4096))
    engine = Engine.load(out, random_seed=1234)
    attn = make_program(engine.spec, max_seq_len=4096).graph.op("layers.0.attention").attrs
    assert prefill // attn["tile"]["chunks"] > 2 * MLA_KEYS
    for step, _, _, env in forced_steps(engine, 11, torch.bfloat16, prefill, steps=4):
        for layer in range(engine.spec.num_layers):
            key = f"layers.{layer}.o_latent"
            got = engine._act(key).float().cpu().reshape(-1)
            want = env[key][0].float().cpu().reshape(-1)
            tol = 1e-3 * float(want.abs().max())
            assert torch.allclose(got, want, rtol=1e-3, atol=tol), (
                f"step {step}, {key}: max difference {float((got - want).abs().max()):.3g}")
