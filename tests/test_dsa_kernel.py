"""The DSA lightning indexer (DeepSeek-V3.2, GLM-5) in the CUDA backend, on the CPU: what the
codegen accepts and refuses, the DSA artifacts (tiny and full-size compile without spills, bf16
and FP8, other cubins do not carry DSA code), the kernel's top-k selection (run_dsa_topk)
against the interpreter's on scores with ties, and a whole decode step of the kernel's own
device code run on the host (tests/host_kernel.cpp: `step`) against the interpreter, at
contexts shorter and longer than index_topk, with bf16 and FP8 weights.

The kernel against the interpreter on a GPU is in tests/test_cuda_kernel.py (DSA_MODELS).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from test_fp8_kernel import needs_nvcc
from test_mla_kernel import (
    assert_step_matches,
    broken_host_step,
    build_step_harness,
    random_host_step,
    small,
)
from test_moe_kernel import TOOL, columns

import tilertc
from tilertc.backends.cuda import codegen
from tilertc.backends.cuda.encode import (
    DIGIT_FIELDS,
    DSA_FIELDS,
    FIELDS,
    MLA_FIELDS,
    MLA_FP8_FIELDS,
    MOE_FIELDS,
    OPCODES,
    SHARED_FIELDS,
    encode_task,
    fields,
)
from tilertc.driver import CompileOptions, compile
from tilertc.ir import dsa  # noqa: F401  (registers the DSA opcodes' semantics)
from tilertc.ir.interpreter import SEMANTICS
from tilertc.model_specs.hf import with_weight_dtype
from tilertc.model_specs.spec import ModelSpec
from tilertc.passes.pipeline import make_program
from tilertc.passes.program import ScheduleError
from tilertc.passes.synchronization import waits_at
from tilertc.passes.verify import VerificationError, verify

TOPK = 16  # index_topk of the host tests: contexts on both sides of it stay cheap
# Full-size DeepSeek-V3.2 (bf16) with 3 dense and 1 MoE layer, and a smaller vocabulary
FULL = {"quantization_config": None, "num_hidden_layers": 4, "first_k_dense_replace": 3,
        "vocab_size": 32000}


def interpreter_topk(scores: torch.Tensor, k: int) -> list[list[int]]:
    """The interpreter's dsa_topk of scores [T, n]."""
    return SEMANTICS["dsa_topk"](SimpleNamespace(attrs={"topk": k}), [scores], None)[0].tolist()


def dsa_tiny(name: str = "deepseek-v3.2-tiny", **overrides: Any) -> ModelSpec:
    return tilertc.load_spec(name, overrides={"index_topk": TOPK, **overrides})


# -- what the codegen takes ----------------------------------------------------------------------

def test_codegen_takes_dsa_and_compiles_dsa_code_only_for_it() -> None:
    consts = codegen.constants(tilertc.schedule(tilertc.load_spec("deepseek-v3.2-tiny"),
                                                max_seq_len=512))
    assert {k: v for k, v in consts.items() if k.startswith("DSA")} == {
        "DSA": 1, "DSA_HEADS": 4, "DSA_DIM": 16, "DSA_TOPK": 8, "DSA_KEYS": 64,
        "DSA_SOFTMAX_SCALE": "0.25f", "DSA_HEAD_WEIGHT_SCALE": "0.5f",
        "DSA_ROPE_INTERLEAVED": 0}
    glm = codegen.constants(tilertc.schedule(tilertc.load_spec("glm-5-tiny")))
    assert glm["DSA_ROPE_INTERLEAVED"] == 1  # GLM-5 pairs its indexer's RoPE interleaved
    for name in ("llama-tiny", "deepseek-v3-tiny"):
        other = codegen.constants(tilertc.schedule(tilertc.load_spec(name)))
        assert other["DSA"] == 0 and not any(k.startswith("DSA_") for k in other)


def test_an_indexer_rope_other_than_mlas_is_refused_by_name() -> None:
    """The indexer reads MLA's RoPE table: other parameters (here: more rotated dims) would
    need a table of their own."""
    program = tilertc.schedule(dsa_tiny())
    program.graph.op("layers.1.dsa.score").attrs["rotary_dim"] = 16
    with pytest.raises(ScheduleError, match="op 'layers.1.dsa.score': not yet in the CUDA "
                                            "backend: an indexer RoPE other than MLA's"):
        codegen.check_supported(program)


# -- the artifacts -----------------------------------------------------------------------------

def test_dsa_artifacts_compile_without_spills(tmp_path: Path) -> None:
    """The tiny spec and full-size DeepSeek-V3.2 (64 index heads of 128, top-2048 of a 4096
    context) compile into one checked kernel without spills; their tables have the DSA fields,
    every layer an indexer of 32 chunks and one top-k task, attention reading its ids."""
    needs_nvcc()
    for name, spec, layers in (("tiny", tilertc.load_spec("deepseek-v3.2-tiny"), 3),
                               ("full", tilertc.load_spec("deepseek-v3.2", overrides=FULL), 4)):
        out = compile(spec, tmp_path / name, CompileOptions(max_seq_len=4096))
        assert subprocess.run([sys.executable, str(TOOL), str(out)]).returncode == 0
        col, m = columns(out)
        assert m["task_fields"] == [*FIELDS, *MOE_FIELDS, *SHARED_FIELDS, *MLA_FIELDS,
                                    *DSA_FIELDS]
        assert "#define DSA 1" in (out / "kernel.cu").read_text()
        assert m["kernel"]["ptxas"].get("spill_stores", 0) == 0, m["kernel"]["ptxas"]
        assert m["kernel"]["ptxas"].get("stack_bytes", 0) == 0, m["kernel"]["ptxas"]
        assert (col["opcode"] == OPCODES["dsa_score"]).sum() == layers * 32
        assert (col["opcode"] == OPCODES["dsa_topk"]).sum() == layers
        attn = col["opcode"] == OPCODES["mla_attention"]
        topk = {m["buffers"][f"layers.{i}.dsa.topk"]["offset"] for i in range(layers)}
        assert set(col["aux2"][attn].tolist()) == topk
        assert set(m["kv_cache"]["layers"]["0"]) == {"latent", "index_keys"}


def test_fp8_dsa_artifacts_compile_without_spills(tmp_path: Path) -> None:
    """Full-size DeepSeek-V3.2 in its checkpoint's FP8 format and GLM-5 with FP8 weights (3
    dense layers and 1 MoE layer each) compile into one checked kernel without spills, with
    ready digits (the dense FFNs' tiles take them). Every projection streams FP8 (attention's,
    kv_b's derived rows, the indexer's wq_b and wk, the dense and shared experts' and the routed
    experts') but the router, the indexer's head weights and lm_head, which stay bf16 as in the
    checkpoints; q absorption's rows carry one scale per 128 (DeepSeek) or 64 (GLM-5: heads of
    448 kv_b rows) columns."""
    needs_nvcc()
    full = {k: v for k, v in FULL.items() if k != "quantization_config"}
    for base, w_uk_cols in (("deepseek-v3.2", 128), ("glm-5", 64)):
        spec = tilertc.load_spec(base, overrides=full)
        out = compile(spec, tmp_path / base, CompileOptions(max_seq_len=4096, weight_dtype="fp8"))
        assert subprocess.run([sys.executable, str(TOOL), str(out)]).returncode == 0
        col, m = columns(out)
        assert m["task_fields"] == [*FIELDS, *MOE_FIELDS, *SHARED_FIELDS, *MLA_FIELDS,
                                    *MLA_FP8_FIELDS, *DSA_FIELDS, *DIGIT_FIELDS]
        assert m["kernel"]["ptxas"].get("spill_stores", 0) == 0, (base, m["kernel"]["ptxas"])
        assert m["kernel"]["ptxas"].get("stack_bytes", 0) == 0, (base, m["kernel"]["ptxas"])
        formats = {seg[0]: e["format"] for e in m["weights"]["layout"] for seg in e["segments"]}
        bf16 = {n for n, f in formats.items() if f == "bf16"}
        assert bf16 and all(n.endswith(("indexer.weights_proj.weight", "mlp.gate.weight"))
                            or n == "lm_head.weight" for n in bf16), sorted(bf16)
        assert any("kv_b_proj" in n and f == "fp8_e4m3" for n, f in formats.items())
        assert any("shared_experts.down_proj" in n and f == "fp8_e4m3" for n, f in formats.items())
        heads = col["opcode"] == OPCODES["head_matvec"]
        nope = spec.mla.qk_nope_head_dim
        shifts = {(int(k), int(sh)) for k, sh in zip(col["k"][heads], col["scale_shift"][heads],
                                                       strict=True)}
        assert shifts == {(nope, (w_uk_cols // 4).bit_length() - 1), (512, 5)}


# -- the top-k selection, run on the host --------------------------------------------------------

def topk_cases(gen: torch.Generator) -> list[torch.Tensor]:
    """Scores of contexts below, at and above TOPK: random; rounded to a few values (many
    exact ties, at the k-th place too); all zero (every head's ReLU zero); a run of equal
    scores straddling the cut; negative and positive zeros; one score far above the rest;
    scores apart only in their last significand bits (the selection's every digit decides); a
    context of more keys a thread than run_dsa_topk keeps in shared memory (TOPK_STAGED, 78
    at this test's two compute warps)."""
    cases = []
    for n in (1, 5, TOPK, TOPK + 1, 40, 300, 1000, 3000):
        cases.append(torch.randn(n, generator=gen))
        cases.append((torch.randn(n, generator=gen) * 2).round())
        cases.append(torch.zeros(n))
    for n in (50, 700):
        x = torch.randn(n, generator=gen)
        order = x.argsort(descending=True)
        x[order[TOPK - 4:TOPK + 5]] = float(x[order[TOPK - 1]])
        cases.append(x)
        y = torch.zeros(n)
        y[torch.randperm(n, generator=gen)[: n // 2]] = -0.0
        y[torch.randperm(n, generator=gen)[:3]] = 1.0
        cases.append(y)
    for n in (300, 3000):
        cases.append(1.0 + torch.randint(0, 40, (n,), generator=gen) * 2.0 ** -23)
    # more keys a thread than shared memory keeps (the rest read from L2 where used)
    cases.append((torch.randn(6000, generator=gen) * 2).round())
    return cases


@pytest.mark.parametrize("max_seq_len", [2048, 8192])
def test_kernel_topk_is_the_interpreters(tmp_path: Path, max_seq_len: int) -> None:
    """run_dsa_topk (a radix selection, then prefixes of the tied and chosen counts) picks the
    interpreter's tokens in its order: the TOPK largest scores, equal scores (-0.0 and 0.0
    too) to the earlier token, in increasing token order, -1 past the context's tokens. With
    a cache of 2048 positions every key fits shared memory (TOPK_ALL_STAGED); with 8192 the
    keys past what it holds are read from L2."""
    program = make_program(dsa_tiny(), "h200", max_seq_len=max_seq_len,
                           tuning={"compute_warps": 2})
    consts = codegen.constants(program)
    assert (consts["MAX_K"] // 64 * 64 >= max_seq_len) == (max_seq_len == 2048)
    exe = build_step_harness(tmp_path, consts)
    cases = [x for x in topk_cases(torch.Generator().manual_seed(3)) if len(x) <= max_seq_len]
    lines = [f"dsa_topk {len(x)} {' '.join(str(b) for b in x.numpy().view(np.uint32))}"
             for x in cases]
    out = subprocess.run([str(exe)], input="\n".join(lines) + "\n", capture_output=True,
                         text=True, check=True).stdout.strip().split("\n")
    for x, line in zip(cases, out, strict=True):
        want = interpreter_topk(x[None], TOPK)[0]
        assert [int(v) for v in line.split()] == want, f"scores {x.tolist()}"


def test_topk_keeps_every_token_below_index_topk_and_ties_to_the_earlier() -> None:
    """The interpreter's rule itself: below TOPK tokens all are chosen, in order; of equal
    scores at the cut the earlier tokens are chosen."""
    assert interpreter_topk(torch.tensor([[3.0, -1.0, 2.0]]), 4) == [[0, 1, 2, -1]]
    tied = torch.tensor([[1.0, 5.0, 1.0, 1.0, 7.0, 1.0, 0.5]])
    assert interpreter_topk(tied, 4) == [[0, 1, 2, 4]]
    hidden = torch.tensor([[1.0, 2.0, float("-inf"), float("-inf")]])
    assert interpreter_topk(hidden, 4) == [[0, 1, -1, -1]]
    assert interpreter_topk(torch.tensor([[0.0, -0.0, 1.0]]), 2) == [[0, 2]]


def test_attention_marks_its_wait_for_the_selection_only_where_it_runs_the_indexer() -> None:
    """synchronization: a DSA attention's wait for its layer's top-k is marked (the kernel skips
    it while the selection is every token), and its other wait is its queries' (the q
    absorption), which implies its other producers; a GLM-5 layer that reuses the layer before's
    selection waits for its queries only, and nothing is marked; the task rows carry the mark."""
    for name, reusing in (("deepseek-v3.2-tiny", set()), ("glm-5-tiny", {2})):
        program = tilertc.schedule(dsa_tiny(name, index_topk_pattern="FFS")
                                   if reusing else dsa_tiny(name))
        counters = [c.name for c in program.counters]
        for op in program.graph.ops():
            if op.opcode != "mla_attention":
                continue
            layer = int(op.name.split(".")[1])
            waits = [counters[c] for c, _, _ in next(t.waits for t in program.tasks
                                                      if t.op == op.name)]
            if layer in reusing:
                assert "selection_wait" not in op.attrs, op.name
                assert waits == [f"layers.{layer}.q_absorb"], waits
                continue
            mark = op.attrs["selection_wait"]
            assert waits[mark] == f"layers.{layer}.dsa.topk"
            assert waits[1 - mark] == f"layers.{layer}.q_absorb"
        marked = sum("selection_wait" in op.attrs for op in program.graph.ops())
        assert any(f"{marked} DSA attention ops take no wait" in str(d) for d in program.decisions)
        cols = fields(program)
        rows = {t.op: encode_task(program, t, cols=cols) for t in program.tasks}
        assert all(rows[op.name][cols.index("selection_wait")] == op.attrs.get("selection_wait", -1)
                   for op in program.graph.ops())


def test_the_verifier_runs_attention_without_its_selection_wait_below_index_topk() -> None:
    """verify takes the waits the kernel takes at each step's position (synchronization:
    waits_at): below index_topk without the selection wait, and attention then reads its chunk's
    cache rows, not the list. The schedule passes on both sides of index_topk (numeric steps
    at positions 11-16 of TOPK 16, structural at 5 and 40); marking the queries' wait instead
    is caught as a read before its write."""
    program = tilertc.schedule(dsa_tiny())
    attention = next(op for op in program.graph.ops() if op.opcode == "mla_attention")
    task = next(t for t in program.tasks if t.op == attention.name)
    assert waits_at(program, task, TOPK - 1) == [w for i, w in enumerate(task.waits)
                                                 if i != attention.attrs["selection_wait"]]
    assert waits_at(program, task, TOPK) == task.waits
    verify(program, "numeric", prompt_len=12, steps=6, interleavings=2)
    for pos in (5, 40):
        verify(program, "structural", pos=pos)
    for op in program.graph.ops():
        if "selection_wait" in op.attrs:
            op.attrs["selection_wait"] = 1 - op.attrs["selection_wait"]
    with pytest.raises(VerificationError) as err:
        verify(program, "structural", pos=5)
    assert err.value.kind == "read_before_write" and "q_latent" in str(err.value)
    verify(program, "structural", pos=40)  # past index_topk every wait is taken


# -- a decode step of the device code, run on the host ---------------------------------------

def assert_scores_match(bufs: dict[str, torch.Tensor], env: dict[str, torch.Tensor], layer: int,
                        n: int) -> None:
    """The kernel's indexer scores of the n tokens of a layer against the interpreter's fp32
    ones, to 1e-4 relative and 1e-5 of the largest: the tensor cores' bf16 hi + lo queries keep
    ~16 significand bits (bf16 queries alone, ~8, miss it by far)."""
    key = f"layers.{layer}.dsa.scores"
    got, want = bufs[key][:n], env[key][0][:n]
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max())), (
        f"{key}: max difference {float((got - want).abs().max()):.3g} "
        f"of {float(want.abs().max()):.3g}")


# (weights, spec, overrides, target, prompt length): deepseek-v3.2-tiny with index_topk 16 on
# the H200 below the top-k (every token chosen, 32 score chunks mostly empty) and above it (the
# selection chosen by score, attention chunks of the top-k list); on 5 SMs (several keys per
# score chunk and warp, several attention key blocks); on 2 SMs (score chunks of ~100 keys: two
# key blocks, the step's key in the second, read back from the cache); GLM-5-tiny (its
# indexer's RoPE interleaved, a layer reusing the layer before's selection) on 7 SMs. With FP8
# weights (the indexer's wq_b and wk too, its head weights bf16 in an op of their own):
# deepseek-v3.2-tiny above the top-k, and GLM-5-tiny (W_uk's rows with one scale per 8
# columns) on 7 SMs. Below the top-k on 2 SMs: attention takes no wait for the selection, and
# the loader stages the chunks' first key blocks (load_mla_page), but for a block holding the
# step's key.
STEPS = [
    ("bf16", "deepseek-v3.2-tiny", {}, "h200", 10),
    ("bf16", "deepseek-v3.2-tiny", {}, "h200", 100),
    ("bf16", "deepseek-v3.2-tiny", {"index_topk": 256}, small("h200-2", 2), 200),
    ("bf16", "deepseek-v3.2-tiny", {"index_topk": 64}, small("h200-5", 5), 200),
    ("bf16", "deepseek-v3.2-tiny", {"index_topk": 64}, small("h200-2", 2), 200),
    ("bf16", "glm-5-tiny", {"index_topk_pattern": "FFS"}, small("h200-7", 7), 120),
    ("fp8", "deepseek-v3.2-tiny", {}, "h200", 100),
    ("fp8", "glm-5-tiny", {"index_topk_pattern": "FFS"}, small("h200-7", 7), 120),
]


@pytest.mark.parametrize("dtype, name, overrides, target, prefill", STEPS)
def test_kernel_step_with_dsa_on_the_host_is_the_interpreters(
        tmp_path: Path, dtype: str, name: str, overrides: dict[str, Any], target: Any,
        prefill: int) -> None:
    """One decode step of the device library's own code (indexer scores and key append, top-k, MLA
    attention over the selection, MoE, lm_head, sampler) from the task table, packed weights
    and arenas, against the interpreter (bf16 caches as the kernel's) on bf16 or FP8 weights:
    every indexer's scores of the context, its selected token ids exactly, its appended key
    row (to a bf16 rounding step) and untouched prefilled rows; every layer's attention output
    and residuals; the logits and the token."""
    spec = with_weight_dtype(dsa_tiny(name, **overrides), dtype)
    program, got_tok, bufs, env, m = random_host_step(tmp_path, spec, target, prefill)
    n, k = prefill + 1, spec.indexer.topk
    indexers = [i for i in range(spec.num_layers) if spec.indexer.runs_indexer(i)]
    assert indexers == ([0, 1] if name == "glm-5-tiny" else [0, 1, 2])
    for layer in indexers:
        assert_scores_match(bufs, env, layer, n)
        ids = f"layers.{layer}.dsa.topk"
        chosen = env[ids][0].tolist()
        assert bufs[ids].view(torch.int32).tolist() == chosen, ids
        assert sum(i >= 0 for i in chosen) == min(n, k)
        assert n > k or chosen[:n] == list(range(n))  # below index_topk: every token
        cache = m["kv_cache"]["layers"][str(layer)]["index_keys"]
        rows = bufs[cache].view(-1, spec.indexer.head_dim)
        want = env[cache][prefill].float()
        assert torch.allclose(rows[prefill].float(), want, rtol=1e-2,
                              atol=1e-3 * float(want.abs().max())), cache
        assert torch.equal(rows[:prefill].float(), env[cache][:prefill].float())
        assert not rows[n:].float().any(), "rows past the step were written"
    assert_step_matches(bufs, env, got_tok, spec.num_layers, ("o_latent", "x.attn", "x.ffn"))


# The negative controls of the step test's scores: run_dsa_score's mma fragment mappings and its
# reduction over heads broken one at a time (the device library's text replaced in what the harness
# compiles), and the queries' bf16 lo half left out, each of which must fail it.
QUERY_LO = ("      mla_a_fragment(a, qs + DSA_MT * 16 * DSA_ROW, DSA_ROW, 16 * k, lane);\n"
            "      mma_bf16_16816(d, a, b0, b1);\n")
BROKEN_DSA = {
    "B fragment from the wrong lanes": ("row = m.rows() + (n0 + g) * DSA_ROW + 2 * q;",
                                        "row = m.rows() + (n0 + q) * DSA_ROW + 2 * g;"),
    "B halves swapped": ("b0 = bf16_pair(row + 16 * k), b1 = bf16_pair(row + 16 * k + 8);",
                         "b1 = bf16_pair(row + 16 * k), b0 = bf16_pair(row + 16 * k + 8);"),
    "weights of neighbouring heads": ("w0 = m.w()[mt * 16 + g],", "w0 = m.w()[mt * 16 + (g ^ 1)],"),
    "heads summed over the wrong lanes": ("for (int o = 4; o < 32; o <<= 1) {  // over g",
                                          "for (int o = 1; o < 8; o <<= 1) {  // over g"),
    "query lo half dropped": (QUERY_LO, ""),
}


@pytest.mark.parametrize("broken", BROKEN_DSA)
def test_a_broken_dsa_score_fails_the_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           broken: str) -> None:
    spec = dsa_tiny()
    _, _, bufs, env, _ = broken_host_step(tmp_path, monkeypatch, *BROKEN_DSA[broken], spec,
                                          "h200", 100)
    with pytest.raises(AssertionError, match="dsa.scores: max difference"):
        for layer in range(spec.num_layers):
            assert_scores_match(bufs, env, layer, 101)
