"""The persistent kernel against the interpreter, on a GPU.

Teacher-forced: after a prefill, both the kernel and the interpreter (float32, same bf16
weights) are fed the same tokens step by step and their logits compared. Greedy tokens must
agree wherever the reference's top-2 margin is clearly above bf16 noise, and the in-kernel
token loop must produce the same tokens as repeated single steps.

Sampling (temperature, top-k, top-p): the kernel's token at every step must be the one
ir/sampling.py's reference draws from the kernel's own logits of that step, with the same seed
and position, wherever the reference's choice is not within rounding of a tie; the token loop
must again equal single steps, and seeds must reproduce.

FP8 (`weight_dtype="fp8"`): the same teacher-forced check and token loop, the interpreter
running the same e4m3 weights and block scales, for the dense tiny models, llama-3.2-1b,
qwen3-moe-tiny and the MLA and DSA models above (MLA's kv_b rows, the shared expert's, the
indexer's wq_b and wk in FP8), with their routing and selection checks; full-size
DeepSeek-V3.2 (its checkpoint's FP8 format) and GLM-5 attention in FP8 pass the teacher-forced
check, the token loop and the selection check.

Split-K FFN (`ffn_split_k=True`): the same teacher-forced check and token loop.

MoE (qwen3-moe-tiny and deepseek-v3-tiny run every test above): the router's decisions, the
expert ids of every layer at every teacher-forced step, must be the interpreter's, and their
combine weights too; deepseek-v3-tiny has a dense first layer, then MoE layers with DeepSeek's
router (sigmoid scores, correction bias, group-limited top-k) and a shared expert, and MLA
attention. Full-size DeepSeek-V3 MoE (one dense and one MoE layer of 256 experts) passes the
teacher-forced check, the token loop and the routing check. With every slot busy (tp 1) the
routed gate/up is tiled about one task per SM: the tinies' 32 rows per slot are one task a
row either way, but full-size DeepSeek-V3's 8 slots become 16 tasks of 128 rows each, and a
wider qwen3-moe-tiny (8 of 16 experts, 768 rows per slot) 16 tasks of 48 rows, 4 ring pages
each, which passes the same three checks.

MLA (deepseek-v3-tiny with a dense FFN in every layer runs every test above): the latent cache
rows the kernel appends must be the interpreter's; full-size DeepSeek-V3 attention (two dense
layers, a smaller vocabulary) passes the teacher-forced check and the token loop.

DSA (deepseek-v3.2-tiny with index_topk 16 and glm-5-tiny, whose last layer reuses the layer
before's selection, run every test above, at contexts above index_topk): the indexer's selected
token ids at every layer and teacher-forced step are the interpreter's (but for near-ties of
its scores at the cut), and so are its appended key rows; the teacher-forced check also runs
from a context below index_topk (every token selected) to one above it; full-size
DeepSeek-V3.2 attention (64 index heads, top-2048 of a 3000-token context) passes the
teacher-forced check, the token loop and the selection check.

Tensor parallelism (TP_MODELS at --tp 2, on two GPUs: dense, MLA, MoE with expert
parallelism, FP8): the teacher-forced check on every rank's vocabulary rows gathered, the token
loop, EOS, residual streams bit-identical across ranks, every rank's routing (its shard's
chosen experts), and non-greedy sampling refused.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

import tilertc
from tilertc.choice_check import ChoiceCheck, check_choices, score_scales
from tilertc.driver import CompileOptions, compile
from tilertc.engine import Engine
from tilertc.ir.sampling import SamplingParams, sample

pytestmark = pytest.mark.gpu

# Models the kernel runs only with overrides of a built-in spec: DeepSeek-V3 with a dense FFN
# in every layer, tiny; DeepSeek-V3 at full size (without the V3.2 indexer, bf16, a smaller
# vocabulary so that lm_head stays small): two dense layers, or one dense and one MoE layer.
FULL_SIZE = {"model_type": "deepseek_v3", "quantization_config": None, "vocab_size": 32000}
VARIANTS = {
    "deepseek-v3-tiny-dense": ("deepseek-v3-tiny", {"first_k_dense_replace": 3}),
    # wide enough that its FP8 dense FFN and attention input projections tile (ready digits)
    "deepseek-v3-tiny-dense-wide": ("deepseek-v3-tiny", {
        "hidden_size": 1024, "intermediate_size": 2048, "first_k_dense_replace": 3}),
    # llama-tiny widened so that its FP8 projections tile both ways, 16 rows x 4 segments (K =
    # 1536) and 8 x 8 (o_proj, K = 1024) (tests/test_fp8_mma.py: WIDE4)
    "llama-tiny-k1536": ("llama-tiny", {"hidden_size": 1536, "intermediate_size": 1536,
                                        "head_dim": 256}),
    # Qwen3-30B-A3B's routing in small (8 of 16 experts, 768 rows per slot, hidden 256): with
    # every slot busy its gate/up slots are tiled 16 tasks of 48 rows each on 132 SMs
    # (tests/test_moe_kernel.py: WIDE, which the host step runs)
    "qwen3-moe-tiny-wide": ("qwen3-moe-tiny", {
        "hidden_size": 256, "num_experts": 16, "num_experts_per_tok": 8,
        "moe_intermediate_size": 768}),
    "deepseek-v3-attention": ("deepseek-v3.2", {
        **FULL_SIZE, "num_hidden_layers": 2, "first_k_dense_replace": 2}),
    "deepseek-v3-moe": ("deepseek-v3.2", {
        **FULL_SIZE, "num_hidden_layers": 2, "first_k_dense_replace": 1}),
    # DSA: a top-k small enough that the tests' contexts exceed it; GLM-5's cross-layer sharing
    "deepseek-v3.2-tiny-topk16": ("deepseek-v3.2-tiny", {"index_topk": 16}),
    "glm-5-tiny-shared": ("glm-5-tiny", {"index_topk_pattern": "FFS"}),
    "deepseek-v3.2-attention": ("deepseek-v3.2", {
        "quantization_config": None, "vocab_size": 32000, "num_hidden_layers": 2,
        "first_k_dense_replace": 2}),
    # FP8 at full size: DeepSeek-V3.2 as its checkpoint ships (ue8m0 scales), GLM-5 (bf16 in
    # its config) compiled with weight_dtype="fp8"
    "deepseek-v3.2-fp8-attention": ("deepseek-v3.2", {
        "vocab_size": 32000, "num_hidden_layers": 2, "first_k_dense_replace": 2}),
    "glm-5-fp8-attention": ("glm-5", {
        "vocab_size": 32000, "num_hidden_layers": 2, "first_k_dense_replace": 2}),
    # slots (and the shared expert) 512 columns wide, hidden 1024: the routed experts' gate/up
    # and down projections as FP8 tiles
    "deepseek-v3-tiny-tiled-moe": ("deepseek-v3-tiny", {"hidden_size": 1024,
                                                        "moe_intermediate_size": 512}),
    # the same with an o_proj that tiles too (8 heads of 64 value dims: K = 512), so that the v
    # expansion can write its digits (tests/test_fp8_mma.py: vexp_digits)
    "deepseek-v3-tiny-tiled-o-proj": ("deepseek-v3-tiny", {
        "hidden_size": 1024, "moe_intermediate_size": 512, "num_attention_heads": 8,
        "v_head_dim": 64}),
    # FP8 under --tp 2: deepseek-v3-tiny with dims whose halves are whole 128-blocks of scales
    # (tests/test_tp.py: ALIGNED)
    "deepseek-v3-tiny-fp8-aligned": ("deepseek-v3-tiny", {
        "num_attention_heads": 16, "num_key_value_heads": 16, "qk_rope_head_dim": 16,
        "intermediate_size": 256, "moe_intermediate_size": 128, "n_shared_experts": 2,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                "weight_block_size": [128, 128]}}),
}
MLA_MODELS = ["deepseek-v3-tiny-dense", "deepseek-v3-tiny"]
MOE_MODELS = ["qwen3-moe-tiny", "deepseek-v3-tiny"]
DSA_MODELS = ["deepseek-v3.2-tiny-topk16", "glm-5-tiny-shared"]
MODELS = ["llama-tiny", "qwen3-tiny", "llama-tiny-odd", "llama-3.2-1b", "qwen3-0.6b",
          "qwen3-moe-tiny", *MLA_MODELS, *DSA_MODELS]
PREFILL, STEPS = 100, 64
# At most this share of the steps (or choices) may differ from the interpreter's within a tie:
# with FP8 tile projections an indexer's scores carry their input's rounding (about 1e-5 of
# `score_scales`), and at a 3000-token context 3 to 6 steps of 16 swapped two tokens at the cut
# of 2048 (DeepSeek-V3.2, GLM-5 at full size, H200, session 19); such steps are not compared.
TIED_SHARE = 0.5


def load(name: str) -> tilertc.ModelSpec:
    """A built-in spec, or one of VARIANTS."""
    base, overrides = VARIANTS.get(name, (name, None))
    return tilertc.load_spec(base, overrides=overrides)


@pytest.fixture(scope="module", params=MODELS)
def engine(request, tmp_path_factory) -> Engine:
    return compiled_engine(request.param, tmp_path_factory)


def compiled_engine(name: str, tmp_path_factory, **options) -> Engine:
    """`name` (a built-in spec or one of VARIANTS) compiled with `options` for a 512-token
    context, loaded with random weights."""
    out = compile(load(name), tmp_path_factory.mktemp(name),
                  CompileOptions(max_seq_len=512, **options))
    return Engine.load(out, random_seed=1234)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_teacher_forced_logits_match_interpreter(engine: Engine) -> None:
    check_teacher_forced(engine)


def forced_steps(engine: Engine, seed: int, cache_dtype: torch.dtype | None = None,
                 prefill: int = PREFILL, steps: int = STEPS
                 ) -> Iterator[tuple[int, int, torch.Tensor, dict[str, torch.Tensor]]]:
    """Teacher-forced steps: after a random prompt prefilled in both, feed the kernel and the
    interpreter (float32, the engine's weights; its KV cache in `cache_dtype`, and then
    prefilled as the engine prefills, in float32, and rounded as the engine copies it, so that
    both start from the same cache) the same random tokens; yields (step, the kernel's token,
    its logits, the interpreter's tensors)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.spec.vocab_size
    prompt = torch.randint(0, vocab, (prefill,), generator=gen)
    feed = torch.randint(0, vocab, (steps,), generator=gen)
    engine.position = 0
    engine.prefill(prompt)
    ref = engine.reference(cache_dtype)
    for i, tok in enumerate(feed.tolist()):
        got_tok, got = engine.step(tok)
        yield i, got_tok, got, ref.run(torch.tensor([tok]), torch.tensor([prefill + i]))


def check_teacher_forced(engine: Engine, prefill: int = PREFILL, steps: int = STEPS) -> None:
    """The kernel's logits step by step against the interpreter's with the engine's weights
    (for an FP8 artifact: the same e4m3 weights and scales, dequantized in float32). With a
    DSA indexer or MoE the interpreter keeps its caches in bf16 as the kernel does: the
    selection and the routing are discontinuous in their scores, and a float32 cache moves them
    enough to swap tokens or experts. A step at which the kernel routed or selected otherwise
    than the interpreter (only allowed within a tie, `chose_as_interpreter`) has different
    logits by design and is not compared; at most half the steps may be such (TIED_SHARE)."""
    errs, agree, checked, tied = [], 0, 0, 0
    routers = [op for op in engine.graph.ops() if op.opcode == "moe_router"]
    cache = torch.bfloat16 if engine.spec.indexer or routers else None
    for i, got_tok, got, env in forced_steps(engine, 7, cache, prefill, steps):
        assert got_tok == int(got.argmax()), "the kernel's token is not the argmax of its logits"
        if not all(c.same for c in chose_as_interpreter(engine, env, i)):
            tied += 1
            continue
        want = env["logits"][0]
        errs.append(rel_err(got, want))
        top2 = want.topk(2).values
        if float(top2[0] - top2[1]) > 2e-2 * float(want.abs().max()):
            checked += 1
            agree += int(got_tok == int(want.argmax()))
            assert got_tok == int(want.argmax()), f"step {i}: greedy token differs"
    assert tied <= TIED_SHARE * steps, f"{tied} of {steps} steps chose otherwise within a tie"
    assert max(errs) <= 2e-2, f"max relative error {max(errs):.3g} (median {np.median(errs):.3g})"
    assert checked >= steps // 4, "too few steps with a clear top-2 margin to check greedy tokens"


def test_attention_chunks_over_several_ring_pages(tmp_path) -> None:
    """Attention streams each context chunk's past keys and values through the weight ring; with
    4 KB pages (16 keys of llama-tiny-odd's head_dim 64) and 32 chunks, a 600-token context
    spreads every chunk over two or more pages, and over page boundaries of the ring."""
    spec = tilertc.load_spec("llama-tiny-odd")
    out = compile(spec, tmp_path, CompileOptions(max_seq_len=640, page_kb=4))
    engine = Engine.load(out, random_seed=4321)
    k = engine.m["kernel"]["constants"]
    attention = tilertc.schedule(spec, max_seq_len=640).graph.op("layers.0.attention")
    chunks = attention.attrs["tile"]["chunks"]
    assert 600 // chunks > 16 and k["PAGE_BYTES"] // (4 * k["HEAD_DIM"]) == 16
    check_teacher_forced(engine, prefill=600, steps=16)


def test_eight_query_heads_a_kv_head_match_interpreter(tmp_path) -> None:
    """Groups of 8 query heads of 128 dims a KV head (Qwen3-32B, Qwen3-30B-A3B) split the
    heads over two sets of warps (decode/attention.cuh: HEAD_SETS), each key read by a warp of each
    set; teacher-forced logits match the interpreter with 16 compute warps on every chunk."""
    spec = tilertc.load_spec("qwen3-tiny", overrides={"num_attention_heads": 16, "head_dim": 128})
    engine = Engine.load(compile(spec, tmp_path, CompileOptions(max_seq_len=512)), random_seed=77)
    k = engine.m["kernel"]["constants"]
    assert (k["GROUP"], k["HEAD_DIM"], k["COMPUTE_WARPS"]) == (8, 128, 16)
    check_teacher_forced(engine)


# How far two runs of one step may put the best logit above another's, relative to the largest
# |logit|, for the other to count as a tie: rows that several warps share add in shared memory
# in the order the warps come, and a repeated step's logits moved by up to 4.6e-6 of the
# largest (llama-3.2-1b bf16, H200, tools/loop_check.py, session 28). FP8 tile sums add in a
# fixed order (session 29).
NEAR_TIE = 1e-4


def test_token_loop_equals_single_steps(engine: Engine, near_tie: float = NEAR_TIE) -> None:
    """A launch of 32 steps, the kernel feeding itself its tokens, against one launch a step
    fed the loop's tokens: every step chooses the loop's token, or one whose logit the loop's
    is within `near_tie` of (at most a few such steps)."""
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, engine.spec.vocab_size, (PREFILL,), generator=gen)
    engine.position = 0
    looped = list(engine.generate(prompt, max_new_tokens=32))
    engine.position = 0
    engine.prefill(prompt[:-1])
    tok, ties = int(prompt[-1]), 0
    for i, want in enumerate(looped):
        got, logits = engine.step(tok)
        if got != want:
            gap = float(logits.max() - logits[want]) / float(logits.abs().max())
            assert gap <= near_tie, f"step {i}: loop {want}, single step {got} (gap {gap:.3g})"
            ties += 1
        tok = want
    assert ties <= 2, f"{ties} of 32 steps chose another token within a tie"


def chose_as_interpreter(engine: Engine, env: dict[str, torch.Tensor], step: int
                         ) -> list[ChoiceCheck]:
    """Every router's and indexer's choice at the last step against the interpreter's; where
    one differs, only within rounding of a tie (`choice_check.check_choices`)."""
    checks = check_choices(engine, env)
    bad = [str(c) for c in checks if not c.ok]
    assert not bad, f"step {step}: " + "; ".join(bad)
    return checks


def check_routing(engine: Engine, steps: int = STEPS) -> None:
    """Teacher-forced steps: after each, every layer's routing is the interpreter's but for
    ties (`chose_as_interpreter`). The interpreter keeps its KV cache in bf16 as the kernel
    does, so that the two routers see the same hidden state up to summation order, not up to
    the cache's rounding."""
    routers = [op for op in engine.graph.ops() if op.opcode == "moe_router"]
    compared = 0
    for i, _, _, env in forced_steps(engine, 17, torch.bfloat16, steps=steps):
        compared += sum(c.same for c in chose_as_interpreter(engine, env, i) if c.op == "routing")
    assert compared >= (1 - TIED_SHARE) * steps * len(routers), (
        "too many routing decisions within a tie")


@pytest.mark.parametrize("name", MOE_MODELS)
def test_moe_routing_decisions_match_interpreter(name: str, tmp_path) -> None:
    out = compile(load(name), tmp_path, CompileOptions(max_seq_len=512))
    check_routing(Engine.load(out, random_seed=1234))


def test_moe_one_routed_gate_up_task_per_sm_matches_interpreter(tmp_path) -> None:
    """Every slot busy (tp 1): a slot's gate/up rows in #SMs // slots tasks, about one per SM
    (passes/tiling.py: routed_tasks_per_slot). qwen3-moe-tiny-wide on the H200 with 4 KB pages:
    8 slots x 16 tasks of 48 rows, one per SM, each streaming 4 ring pages of 12 KB (a page is
    at least a down row): teacher-forced logits, the token loop and the routing decisions."""
    from test_moe_kernel import routed_tiling

    from tilertc.passes.pipeline import make_program

    spec = load("qwen3-moe-tiny-wide")
    program = make_program(spec, "h200", 1, 512, {"page_kb": 4})
    assert routed_tiling(program) == {"tasks_per_slot": 16, "rows": 48, "pages": 4, "per_sm": 1}
    out = compile(spec, tmp_path, CompileOptions(max_seq_len=512, page_kb=4))
    engine = Engine.load(out, random_seed=1234)
    check_teacher_forced(engine)
    test_token_loop_equals_single_steps(engine)
    check_routing(engine)


@pytest.mark.parametrize("name", MLA_MODELS)
def test_mla_latent_cache_rows_match_interpreter(name: str, tmp_path) -> None:
    """Teacher-forced steps: the latent cache rows the kernel appended (normed latent, rotated
    k_pe; bf16) are the interpreter's, computed with a bf16 cache as the kernel keeps it, to
    within a bf16 rounding step (and the prefilled rows the engine copied in); no row past the
    last step is written."""
    out = compile(load(name), tmp_path, CompileOptions(max_seq_len=512))
    engine = Engine.load(out, random_seed=1234)
    steps = list(forced_steps(engine, 23, torch.bfloat16))
    env = steps[-1][3]
    cfg = engine.m["kv_cache"]
    for names in cfg["layers"].values():
        b = engine.m["buffers"][names["latent"]]
        got = engine.kv[b["offset"]: b["offset"] + b["numel"]].view(-1, cfg["width"]).float()
        want = env[names["latent"]].float()
        rows = PREFILL + STEPS
        scale = float(want[:rows].abs().max())
        assert torch.allclose(got[:rows], want[:rows], rtol=1e-2, atol=1e-3 * scale), (
            f"{names['latent']}: max difference "
            f"{float((got[:rows] - want[:rows]).abs().max()):.3g}")
        assert not got[rows:].any(), "rows past the last step were written"


def test_full_size_mla_attention_matches_interpreter(tmp_path) -> None:
    """DeepSeek-V3's attention at full size (128 heads in groups of 16, latent rank 512, rope
    64, 32 context chunks) with random weights: teacher-forced logits and the token loop."""
    out = compile(load("deepseek-v3-attention"), tmp_path, CompileOptions(max_seq_len=512))
    engine = Engine.load(out, random_seed=1234)
    check_teacher_forced(engine)
    test_token_loop_equals_single_steps(engine)


def test_full_size_deepseek_moe_matches_interpreter(tmp_path) -> None:
    """DeepSeek-V3's MoE at full size (256 experts in 8 groups, 8 per token from 4 groups, a
    2048-wide shared expert; ~23 GB of experts in one layer) after a dense layer, with random
    weights: teacher-forced logits, the token loop and the routing decisions."""
    out = compile(load("deepseek-v3-moe"), tmp_path, CompileOptions(max_seq_len=512))
    engine = Engine.load(out, random_seed=1234)
    check_teacher_forced(engine, steps=16)
    test_token_loop_equals_single_steps(engine)
    check_routing(engine, steps=16)


def check_selection(engine: Engine, prefill: int = PREFILL, steps: int = STEPS) -> None:
    """Teacher-forced steps: after each, every indexer's selected token ids are the
    interpreter's (bf16 caches as the kernel's) but for ties (`chose_as_interpreter`), and the
    scores of the prefilled tokens (key rows the same in both caches) of every indexer that saw
    the interpreter's input (no earlier layer chose otherwise) are its fp32 ones to the tensor
    cores' ~16 significand bits (2^-14 of `score_scales`; the rows appended since may differ
    by a bf16 step); at the end, the index key rows the kernel appended are the interpreter's
    to a bf16 step (but a layer's rows of steps at which an earlier layer chose otherwise),
    and none past the last step is written."""
    compared = checked = 0
    diverged = []  # per step: the first layer that chose otherwise (later ones saw other input)
    for i, _, _, env in forced_steps(engine, 29, torch.bfloat16, prefill, steps):
        scores = engine.index_scores()
        checks = chose_as_interpreter(engine, env, i)
        diverged.append(next((c.layer for c in checks if not c.same), engine.spec.num_layers))
        for c in checks:
            if c.op != "selection":
                continue
            checked += 1
            compared += c.same
            if c.downstream:
                continue
            want = env[f"layers.{c.layer}.dsa.scores"][0][:prefill]
            got = scores[c.layer][:prefill].to(want.device)
            apart, scale = (got - want).abs().double(), score_scales(engine, env, c.layer, prefill)
            assert (apart <= 2 ** -14 * scale).all(), (
                f"step {i}, layer {c.layer}: scores {float((apart / scale).max()):.3g} of their "
                "scale apart")
    assert compared >= (1 - TIED_SHARE) * checked, "too many selections within a tie"
    end = prefill + steps
    for layer, names in engine.m["kv_cache"]["layers"].items():
        if "index_keys" not in names:
            continue
        b = engine.m["buffers"][names["index_keys"]]
        want = env[names["index_keys"]].float()
        got = engine.kv[b["offset"]: b["offset"] + b["numel"]].view(want.shape).float()
        # a layer's key row of a step at which an earlier layer chose otherwise has other input
        rows = [*range(prefill), *(prefill + i for i, d in enumerate(diverged) if d >= int(layer))]
        scale = float(want[:end].abs().max())
        assert torch.allclose(got[rows], want[rows], rtol=1e-2, atol=1e-3 * scale), names
        assert not got[end:].any(), "rows past the last step were written"


@pytest.mark.parametrize("name", DSA_MODELS)
def test_dsa_selection_matches_interpreter(name: str, tmp_path) -> None:
    out = compile(load(name), tmp_path, CompileOptions(max_seq_len=512))
    check_selection(Engine.load(out, random_seed=1234))


def test_dsa_from_below_to_above_index_topk(tmp_path) -> None:
    """Teacher-forced from a 4-token context (every token selected, attention dense over its
    list) to 28 tokens (16 selected by score), and the token loop across the same boundary."""
    out = compile(load("deepseek-v3.2-tiny-topk16"), tmp_path, CompileOptions(max_seq_len=512))
    engine = Engine.load(out, random_seed=1234)
    check_teacher_forced(engine, prefill=4, steps=24)
    check_selection(engine, prefill=4, steps=24)


def test_full_size_dsa_attention_matches_interpreter(tmp_path) -> None:
    """DeepSeek-V3.2's attention at full size (128 heads, 64 index heads of 128, index_topk
    2048) after a 3000-token prompt, so that the selection leaves tokens out: teacher-forced
    logits, the token loop and the selection."""
    out = compile(load("deepseek-v3.2-attention"), tmp_path, CompileOptions(max_seq_len=4096))
    engine = Engine.load(out, random_seed=1234)
    check_teacher_forced(engine, prefill=3000, steps=16)
    check_selection(engine, prefill=3000, steps=16)
    test_token_loop_equals_single_steps(engine)


FP8_MODELS = ["llama-tiny", "qwen3-tiny", "llama-tiny-odd", "llama-3.2-1b", "qwen3-moe-tiny",
              *MLA_MODELS, *DSA_MODELS]


@pytest.fixture(scope="module", params=FP8_MODELS)
def fp8_engine(request, tmp_path_factory) -> Engine:
    """FP8 rows on the CUDA cores (the tiles, on by default where they fit, have their own
    GPU tests: tests/test_fp8_mma.py)."""
    return compiled_engine(request.param, tmp_path_factory, weight_dtype="fp8", fp8_mma=False)


def test_fp8_teacher_forced_logits_match_interpreter(fp8_engine: Engine) -> None:
    assert fp8_engine.m["kernel"]["constants"]["WEIGHT_FP8"] == 1
    check_teacher_forced(fp8_engine)


def test_fp8_token_loop_equals_single_steps(fp8_engine: Engine) -> None:
    test_token_loop_equals_single_steps(fp8_engine)


def test_fp8_routing_and_selection_match_interpreter(fp8_engine: Engine) -> None:
    """FP8 MoE models: the router's decisions (DeepSeek-V3's beside a shared expert whose
    pieces are FP8 too); FP8 DSA models: the indexer's selection (its wq_b and wk FP8)."""
    spec = fp8_engine.spec
    if spec.moe is None and spec.indexer is None:
        pytest.skip("neither a router nor an indexer")
    if spec.moe is not None:
        check_routing(fp8_engine)
    if spec.indexer is not None:
        check_selection(fp8_engine)


@pytest.mark.parametrize("name", ["deepseek-v3.2-fp8-attention", "glm-5-fp8-attention"])
def test_full_size_fp8_dsa_attention_matches_interpreter(name: str, tmp_path) -> None:
    """DeepSeek-V3.2 with its checkpoint's FP8 format (e4m3, 128x128 blocks, power-of-two
    scales) and GLM-5 with FP8 weights, at full size (two dense layers, a smaller vocabulary),
    after a 3000-token prompt: every projection, the indexer's and kv_b's included, streams
    FP8 rows; W_uk's transposed rows carry one scale per 128 (DeepSeek) or 64 (GLM-5)
    columns. Teacher-forced logits, the token loop and the selection."""
    out = compile(load(name), tmp_path, CompileOptions(max_seq_len=4096, weight_dtype="fp8"))
    engine = Engine.load(out, random_seed=1234)
    from tilertc.backends.cuda.encode import OPCODES

    fields = engine.m["task_fields"]
    heads = engine.tasks[:, fields.index("opcode")] == OPCODES["head_matvec"]
    shifts = set(engine.tasks[heads, fields.index("scale_shift")].tolist())
    assert shifts == {5, 5 if name.startswith("deepseek") else 4}  # W_uv's, W_uk's
    check_teacher_forced(engine, prefill=3000, steps=16)
    check_selection(engine, prefill=3000, steps=16)
    test_token_loop_equals_single_steps(engine)


@pytest.mark.parametrize(("name", "weight"), [
    ("llama-tiny-odd", "model.layers.0.mlp.up_proj.weight"),
    ("deepseek-v3.2-tiny-topk16", "model.layers.1.self_attn.kv_b_proj.weight")])
def test_fp8_artifact_runs_a_bf16_checkpoint_quantized_at_load(name: str, weight: str,
                                                                tmp_path) -> None:
    """bf16 weights given to an FP8 artifact are quantized at load; the kernel then matches the
    interpreter on those quantized weights."""
    from tilertc.ir.weights import random_weights

    spec = load(name)
    out = compile(spec, tmp_path, CompileOptions(max_seq_len=512, weight_dtype="fp8"))
    bf16 = random_weights(tilertc.build_graph(spec, 512), seed=99)
    engine = Engine.load(out, weights=bf16)
    assert engine.weights[weight].dtype == torch.float8_e4m3fn
    check_teacher_forced(engine)


# A dense MLP as one split-K op per layer (CompileOptions(ffn_split_k=True)): the same checks.
SPLIT_K_MODELS = ["llama-tiny", "qwen3-tiny", "llama-tiny-odd", "llama-3.2-1b",
                  "deepseek-v3-tiny-dense"]


@pytest.fixture(scope="module", params=SPLIT_K_MODELS)
def split_k_engine(request, tmp_path_factory) -> Engine:
    return compiled_engine(request.param, tmp_path_factory, ffn_split_k=True)


def test_split_k_teacher_forced_logits_match_interpreter(split_k_engine: Engine) -> None:
    assert split_k_engine.m["kernel"]["constants"]["FFN_SPLIT_K"] == 1
    check_teacher_forced(split_k_engine)


def test_split_k_token_loop_equals_single_steps(split_k_engine: Engine) -> None:
    test_token_loop_equals_single_steps(split_k_engine)


def test_eos_stops_the_loop(engine: Engine) -> None:
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, engine.spec.vocab_size, (16,), generator=gen)
    engine.position = 0
    free = list(engine.generate(prompt, max_new_tokens=8))
    engine.position = 0
    stopped = list(engine.generate(prompt, max_new_tokens=8, eos_token_id=free[2]))
    assert stopped == free[:free.index(free[2]) + 1]


# temperature only (Gumbel-max over every row), top-k, top-p over the vocabulary (nucleus from
# the tasks' softmax partials), and both; a small temperature makes the tiny models' flat
# random logits peaked enough for top-p to matter
SAMPLING = [(0.8, 0, 1.0), (1.0, 40, 1.0), (0.3, 0, 0.9), (0.7, 20, 0.8), (1.0, 1, 1.0)]
SAMPLED_STEPS, SEED = 24, 1234
MARGIN = 1e-4  # the kernel's softmax normalizer is a float32 sum per task


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), SAMPLING)
def test_sampled_tokens_are_the_reference_draw_from_the_kernels_logits(
        engine: Engine, temperature: float, top_k: int, top_p: float) -> None:
    gen = torch.Generator().manual_seed(5)
    vocab = engine.spec.vocab_size
    prompt = torch.randint(0, vocab, (PREFILL,), generator=gen)
    feed = torch.randint(0, vocab, (SAMPLED_STEPS,), generator=gen)
    params = SamplingParams(temperature, top_k, top_p, SEED)
    engine.position = 0
    engine.prefill(prompt)
    checked, drawn = 0, set()
    for i, tok in enumerate(feed.tolist()):
        pos = engine.position
        got, logits = engine.step(tok, temperature, top_k, top_p, SEED)
        want = sample(logits, params, pos)
        drawn.add(got)
        if want.margin > MARGIN:
            checked += 1
            assert got == want.token, f"step {i}: kernel drew {got}, the reference {want}"
            assert engine.nucleus_cut_steps == int(want.cut), f"step {i}: nucleus cut differs"
    assert checked >= SAMPLED_STEPS // 2, "too few steps clear of rounding to compare"
    if top_k != 1:
        assert len(drawn) > 1, "sampling always drew the same token"


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 1.0), (30, 0.9)])
def test_sampled_token_loop_equals_single_steps_and_seeds_reproduce(
        engine: Engine, top_k: int, top_p: float) -> None:
    gen = torch.Generator().manual_seed(13)
    prompt = torch.randint(0, engine.spec.vocab_size, (PREFILL,), generator=gen)
    args = {"temperature": 1.0, "top_k": top_k, "top_p": top_p}

    def loop(seed: int) -> list[int]:
        engine.position = 0
        return list(engine.generate(prompt, max_new_tokens=32, seed=seed, **args))

    looped = loop(SEED)
    engine.position = 0
    engine.prefill(prompt[:-1])
    tok, stepped = int(prompt[-1]), []
    for _ in range(32):
        tok, _ = engine.step(tok, seed=SEED, **args)
        stepped.append(tok)
    assert looped == stepped
    assert loop(SEED) == looped
    assert loop(SEED + 1) != looped


def test_watchdog_turns_a_stall_into_an_error(tmp_path) -> None:
    from tilertc.backends.cuda.encode import FIELDS

    out = compile(tilertc.load_spec("llama-tiny"), tmp_path, CompileOptions(max_seq_len=256))
    eng = Engine.load(out, random_seed=0, watchdog_s=0.5)
    waits = eng.tasks[:, FIELDS.index("wait0")]
    victim = int(torch.nonzero(waits >= 0)[0])
    eng.tasks[victim, FIELDS.index("wait0_n")] = 1000  # a wait no step can ever satisfy
    with pytest.raises(RuntimeError, match="watchdog"):
        eng.step(1)


# -- tensor parallelism: --tp 2 on two GPUs of one host ------------------------------------------
# The all-reduces and the sampler's exchange between ranks (passes/synchronization.py), MoE's
# expert parallelism (Qwen3-MoE's, DeepSeek's with its shared expert split) and FP8 weights cut
# on their scale blocks. Skipped without two GPUs with P2P access.
TP_MOE_MODELS = ["qwen3-moe-tiny", "deepseek-v3-tiny", "deepseek-v3-tiny-fp8-aligned"]
TP_MODELS = ["llama-tiny", "deepseek-v3-tiny-dense", *TP_MOE_MODELS]


@pytest.fixture(scope="module", params=TP_MODELS)
def tp_engine(request, tmp_path_factory) -> Engine:
    if torch.cuda.device_count() < 2:
        pytest.skip("--tp 2 needs two GPUs")
    spec = load(request.param)
    out = compile(spec, tmp_path_factory.mktemp(f"{request.param}-tp2"),
                  CompileOptions(max_seq_len=512, tp=2))
    return Engine.load(out, random_seed=1234, tp=2)


def test_tp_teacher_forced_logits_match_interpreter(tp_engine: Engine) -> None:
    """Every rank's vocabulary rows, gathered, against the interpreter of the whole model."""
    check_teacher_forced(tp_engine)


def test_tp_token_loop_equals_single_steps(tp_engine: Engine) -> None:
    test_token_loop_equals_single_steps(tp_engine)


def test_tp_ranks_hold_identical_residual_streams(tp_engine: Engine) -> None:
    """After a step, every rank's all-reduced residual stream is bit-identical (the sums run in
    rank order on every rank) and every rank decoded the same token."""
    tp_engine.position = 0
    tp_engine.prefill(list(range(1, 20)))
    tp_engine.step(5)
    names = [n for n in tp_engine.m["buffers"] if n.endswith((".x.attn", ".x.ffn"))]
    rank0 = tp_engine.engines[0]
    for e in tp_engine.engines[1:]:
        assert int(e.device_tokens[0]) == int(rank0.device_tokens[0])
        for n in names:
            assert torch.equal(e._act(n).cpu(), rank0._act(n).cpu()), n


def test_tp_routing_decisions_match_interpreter(tp_engine: Engine) -> None:
    """Every rank's slots hold the experts of its shard that the interpreter's router chose,
    best first, with their combine weights (but for ties)."""
    if not any(op.opcode == "moe_router" for op in tp_engine.graph.ops()):
        pytest.skip("no MoE layer")
    check_routing(tp_engine)


def test_tp_eos_stops_every_rank(tp_engine: Engine) -> None:
    test_eos_stops_the_loop(tp_engine)  # a rank that went on would hang the exchanges


def test_tp_refuses_sampling(tp_engine: Engine) -> None:
    with pytest.raises(ValueError, match="sampling under --tp 2 is greedy only"):
        list(tp_engine.generate([1, 2, 3], max_new_tokens=2, temperature=0.8))
