"""Tensor parallelism (`--tp N`) in the CUDA backend, on the CPU: the synchronization pass's
exchange counters, the verifier running every rank's streams, what the codegen refuses, how
the engine cuts each rank's weights and caches, and whole decode steps of the kernel's own
device code run on the host for every rank (tests/host_kernel.cpp `step`, the ranks' arenas as
each other's peers) against the interpreter's unsharded step.

On GPUs (>= 2) the same models run through `Engine` in tests/test_cuda_kernel.py
(`TP_MODELS`).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_fp8_kernel import needs_nvcc
from test_mla_kernel import DENSE, host_step
from test_moe_kernel import TOOL, columns

import tilertc
from tilertc.artifact import ArtifactError
from tilertc.backends.cuda import codegen
from tilertc.backends.cuda.encode import TP_FIELDS
from tilertc.driver import CompileOptions, compile
from tilertc.engine import rank_devices, rank_state, shard_part, shard_weights
from tilertc.ir.weights import random_weights
from tilertc.passes.pipeline import make_program
from tilertc.passes.program import Program, ScheduleError
from tilertc.passes.sharding import exchange_ops
from tilertc.passes.verify import VerificationError, verify

SEQ = 256
FP8 = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                               "weight_block_size": [128, 128]}}
# deepseek-v3-tiny with dims whose halves are whole 128-blocks of FP8 scales: 8 heads per rank of
# q_b rows 16 + 16 (128 rows), kv_b rows 16 + 16, o_proj inputs 16; dense and shared-expert
# halves of 128.
ALIGNED = {"num_attention_heads": 16, "num_key_value_heads": 16, "qk_rope_head_dim": 16,
           "intermediate_size": 256, "moe_intermediate_size": 128, "n_shared_experts": 2}


def program(name: str, tp: int, **overrides: Any) -> Program:
    return make_program(tilertc.load_spec(name, overrides=overrides or None), tp=tp,
                        max_seq_len=SEQ, tuning={"compute_warps": 4})


# -- synchronization and verification ------------------------------------------------------------

def test_synchronization_adds_one_exchange_counter_per_all_reducing_task_and_the_sampler() -> None:
    """tp 1: no exchanges. tp 2: every task of o_proj and down_proj (the all-reduces) and the
    sampler has its own exchange counter, reaching tp per step; nothing else exchanges; the
    ops' counters and waits are tp 1's."""
    one, two = program("llama-tiny", 1), program("llama-tiny", 2)
    assert all(t.exchange < 0 for t in one.tasks)
    assert not any(".exchange" in c.name for c in one.counters)
    ops = exchange_ops(two)
    assert [op.name for op in ops] == [f"layers.{i}.{n}" for i in range(2)
                                       for n in ("o_proj", "ffn.down_proj")]
    exchanging = [t for t in two.tasks if t.exchange >= 0]
    assert {t.op for t in exchanging} == {op.name for op in ops} | {"sample"}
    assert len({t.exchange for t in exchanging}) == len(exchanging)  # one counter each
    assert all(two.counters[t.exchange].per_step == 2 for t in exchanging)
    ops_of = [c.name for c in two.counters if "[" not in c.name and ".exchange" not in c.name]
    assert ops_of == [c.name for c in one.counters if "[" not in c.name]
    assert ([op.attrs["waits"] for op in two.graph.ops()]
            == [op.attrs["waits"] for op in one.graph.ops()])  # the same local waits


@pytest.mark.parametrize("name, tp, overrides", [
    ("llama-tiny", 2, {}), ("llama-tiny", 4, {}), ("qwen3-moe-tiny", 2, {}),
    ("qwen3-moe-tiny", 4, {}), ("deepseek-v3-tiny", 2, DENSE), ("deepseek-v3-tiny", 2, {}),
    ("deepseek-v3.2-tiny", 2, {}), ("deepseek-v3-tiny", 2, {**ALIGNED, **FP8})])
def test_every_ranks_streams_verify(name: str, tp: int, overrides: dict) -> None:
    verify(program(name, tp, **overrides), "structural")


@pytest.mark.parametrize("name, overrides, seq, dtype", [
    ("qwen3-30b-a3b", {}, SEQ, None),
    ("deepseek-v3.2", {"num_hidden_layers": 4, "first_k_dense_replace": 3}, 4096, None),
    ("glm-5", {"num_hidden_layers": 4}, 4096, "bf16"),
    ("glm-5", {"num_hidden_layers": 4}, 4096, "fp8")])
def test_full_size_moe_schedules_at_tp_8_verify(name: str, overrides: dict, seq: int,
                                                dtype: str | None) -> None:
    """The --tp 8 schedules CI compiles: Qwen3-30B-A3B (every layer MoE), DeepSeek-V3.2 as
    shipped (FP8) and GLM-5 in bf16 and FP8 with 3 dense and 1 MoE layer (MLA, DSA, routed and
    shared experts): every rank's streams run to completion with the exchanges."""
    from tilertc.model_specs.hf import with_weight_dtype

    spec = tilertc.load_spec(name, overrides=overrides or None)
    p = make_program(with_weight_dtype(spec, dtype) if dtype else spec, tp=8, max_seq_len=seq)
    assert p.config["sharding"]["experts_per_rank"] == spec.moe.num_experts // 8
    verify(p, "structural")


def test_verifier_catches_an_exchange_counter_that_is_not_the_tasks_own() -> None:
    """Two tasks on one exchange counter: it gets 2 x tp arrivals a step, where tp are
    expected."""
    p = program("llama-tiny", 2)
    a, b = [t for t in p.tasks if t.op == "layers.0.o_proj"][:2]
    b.exchange = a.exchange
    with pytest.raises(VerificationError, match="expects 2 increments per step but 4") as e:
        verify(p, "structural")
    assert e.value.kind == "counter"


def test_verifier_finds_a_rank_that_never_arrives() -> None:
    """An exchange that waits for more arrivals than the ranks give (tp + 1 expected, the
    counter's count raised to match) never completes: a deadlock across ranks, named."""
    p = program("llama-tiny", 2)
    t = next(t for t in p.tasks if t.op == "layers.1.o_proj")
    p.counters[t.exchange].per_step = 3
    p.tp = 3  # the machine runs 3 ranks; the other exchange counters expect 2
    with pytest.raises(VerificationError) as e:
        verify(p, "structural")
    assert e.value.kind in ("counter", "deadlock")


# -- the codegen ------------------------------------------------------------------------------

def test_codegen_refuses_what_tp_does_not_run_by_name() -> None:
    wide = program("llama-tiny", 2)
    wide.tp = 16
    with pytest.raises(ScheduleError, match="--tp 16: the CUDA backend runs at most 8 ranks"):
        codegen.check_supported(wide)


@pytest.mark.parametrize("overrides, weight, what", [
    ({}, "model.layers.0.self_attn.q_b_proj.weight",
     "48 output rows per rank is not a whole number of its 128-row scale blocks"),
    # column-parallel q_b and kv_b aligned (8 heads of 32 rows per rank), o_proj's 8 x 8 inputs not
    ({**ALIGNED, "qk_nope_head_dim": 24, "qk_rope_head_dim": 8, "v_head_dim": 8},
     "model.layers.0.self_attn.o_proj.weight",
     "64 input columns per rank is not a whole number of its 128-column scale blocks")])
def test_fp8_cuts_inside_a_scale_block_are_refused_naming_the_weight(
        overrides: dict, weight: str, what: str) -> None:
    spec = tilertc.load_spec("deepseek-v3-tiny", overrides={**overrides, **FP8})
    with pytest.raises(ScheduleError, match=f"--tp 2: FP8 weight '{weight}' .*: {what}"):
        make_program(spec, tp=2, max_seq_len=SEQ)


def test_fp8_weights_are_cut_with_their_scales_block_for_block() -> None:
    """The aligned FP8 DeepSeek variant at tp 2: every sharded FP8 weight's scale grid is cut
    with it (the manifest records both), and each rank's part of the scales is the one of its
    rows (column-parallel) or columns (row-parallel)."""
    from tilertc.driver import _tp_record

    p = program("deepseek-v3-tiny", 2, **ALIGNED, **FP8)
    g = p.graph
    shards = _tp_record(p)["shards"]
    fp8 = [t for t in g.weights() if "scale_inv" in t.attrs and "shard" in t.attrs]
    assert {t.hf_name.rsplit(".", 2)[-2] for t in fp8} >= {"q_b_proj", "kv_b_proj", "o_proj",
                                                           "gate_proj", "up_proj", "down_proj"}
    for t in fp8:
        scale = g.tensors[t.attrs["scale_inv"]]
        assert shards[scale.hf_name] == shards[t.hf_name]
        axis = t.attrs["shard"]["axis"]
        if "derived" not in t.attrs:  # W_uk / W_uv: rows of kv_b's heads, 2 block rows per rank
            assert scale.shape[axis] * 128 == t.shape[axis]
    w = random_weights(tilertc.build_graph(p.spec, SEQ), seed=1)
    m = {"tp": _tp_record(p)}
    name = "model.layers.0.self_attn.o_proj.weight"
    for r in range(2):
        mine = shard_weights(m, w, r)
        cols = w[name].shape[1] // 2
        assert torch.equal(mine[name].view(torch.uint8),
                           w[name][:, r * cols:(r + 1) * cols].view(torch.uint8))
        blocks = cols // 128
        assert torch.equal(mine[name + "_scale_inv"],
                           w[name + "_scale_inv"][:, r * blocks:(r + 1) * blocks])


def test_moe_at_tp_2_splits_experts_and_all_reduces_after_the_moe_output() -> None:
    """qwen3-moe-tiny (8 experts, top 2) and deepseek-v3-tiny (with a shared expert): at tp 1
    the MoE down projection adds the residual itself; at tp 2 each rank holds 4 experts (rank
    0's in the graph), the router and both expert ops see the shard (`local_experts`, 2 slots),
    the shared expert is split like the dense MLP, and every MoE down task (beside o_proj's
    and the dense down_proj's) exchanges its partial rows with its own counter."""
    for name in ("qwen3-moe-tiny", "deepseek-v3-tiny"):
        one, two = program(name, 1), program(name, 2)
        assert not exchange_ops(one)
        moe = [op for op in two.graph.ops() if op.opcode.startswith("moe_")]
        for op in moe:
            assert op.attrs["local_experts"] == [0, 4] and op.attrs["slots"] == 2, op.name
        down = [op for op in moe if op.opcode == "moe_down_add"]
        assert {op.name for op in down} <= {op.name for op in exchange_ops(two)}
        assert len(down[0].inputs) < len(next(
            op for op in one.graph.ops() if op.name == down[0].name).inputs)
        experts = {t.hf_name.split(".mlp.experts.")[1].split(".")[0]
                   for t in two.graph.weights() if ".mlp.experts." in t.hf_name}
        assert experts == {"0", "1", "2", "3"}
        for op in down:
            tasks = [t for t in two.tasks if t.op == op.name]
            assert all(t.exchange >= 0 for t in tasks)
            assert all(two.counters[t.exchange].per_step == 2 for t in tasks)
            if op.attrs["shared_intermediate"]:  # half the shared expert's columns per rank
                full = next(o for o in one.graph.ops() if o.name == op.name)
                assert op.attrs["shared_intermediate"] * 2 == full.attrs["shared_intermediate"]
        consts = codegen.constants(two)
        assert (consts["MOE_LOCAL"], consts["MOE_SLOTS"]) == (4, 2)
        assert "MOE_LOCAL" not in codegen.constants(one)


def test_rank_experts_are_the_checkpoints_experts_of_the_rank() -> None:
    """Rank r's j-th expert (named as rank 0's in the manifest) is the checkpoint's expert
    4 r + j; the router and the other weights are whole."""
    from tilertc.driver import _tp_record

    p = program("qwen3-moe-tiny", 2)
    m = {"tp": _tp_record(p)}
    assert m["tp"]["experts_per_rank"] == 4
    w = random_weights(tilertc.build_graph(p.spec, SEQ), seed=2)
    pre = "model.layers.1.mlp."
    for r in range(2):
        mine = shard_weights(m, w, r)
        for j in range(4):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                got = mine[f"{pre}experts.{j}.{proj}.weight"]
                assert got is w[f"{pre}experts.{4 * r + j}.{proj}.weight"]
        assert mine[pre + "gate.weight"] is w[pre + "gate.weight"]


def test_tp_constants_only_where_there_are_ranks() -> None:
    one = codegen.constants(program("llama-tiny", 1))
    two_p = program("llama-tiny", 2)
    two = codegen.constants(two_p)
    assert one["TP"] == 1 and "TP_VOCAB_ROWS" not in one
    assert two["TP"] == 2 and two["TP_VOCAB_ROWS"] == two_p.spec.vocab_size // 2
    assert two["TP_STOP_AT"] == two_p.buffers["sample_exchange"].offset + 3


def test_tp_artifacts_compile_without_spills(tmp_path: Path) -> None:
    """llama-tiny at tp 2 and a 3-layer full-size DeepSeek-V3.2 (MLA, the DSA indexer, bf16)
    at tp 8 build checked kernels without spills, their tables with the TP fields and the
    manifest with each sharded weight's part."""
    needs_nvcc()
    full = tilertc.load_spec("deepseek-v3.2", overrides={
        "num_hidden_layers": 3, "quantization_config": None})
    for name, spec, tp in (("llama", tilertc.load_spec("llama-tiny"), 2), ("ds32", full, 8)):
        out = compile(spec, tmp_path / name, CompileOptions(max_seq_len=512, tp=tp))
        assert subprocess.run([sys.executable, str(TOOL), str(out)]).returncode == 0
        col, m = columns(out)
        assert m["task_fields"][-3:] == list(TP_FIELDS)
        assert m["kernel"]["ptxas"].get("spill_stores", 0) == 0, m["kernel"]["ptxas"]
        assert m["kernel"]["ptxas"].get("stack_bytes", 0) == 0, m["kernel"]["ptxas"]
        assert m["tp"]["tp"] == tp
        lm_head = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
        assert m["tp"]["shards"][lm_head] == {"axis": 0, "parts": tp}
        # every exchange counter has its one task in the table
        assert (col["xchg"] >= 0).sum() == sum(1 for c in m["counters"] if ".exchange" in c)


# -- the engine's cut of weights and caches -----------------------------------------------------

def test_shard_parts_split_or_replicate() -> None:
    assert shard_part(8, 4, 1, 2) == slice(4, 8)
    assert [shard_part(2, 1, r, 4) for r in range(4)] == [slice(0, 1)] * 2 + [slice(1, 2)] * 2
    for size, tp in ((2, 2), (3, 4)):  # the ranks would not cover it; not whole parts
        with pytest.raises(ArtifactError, match=f"cannot cut 8 elements into {tp} ranks' "
                                                f"parts of {size}"):
            shard_part(8, size, 0, tp)


def test_rank_weights_and_caches_are_their_heads_rows_and_columns() -> None:
    """llama-tiny (4 heads, 2 KV heads) at tp 4: rank r holds query head r, KV head r // 2
    (replicated on two ranks), its columns of o_proj, a quarter of the MLP and of lm_head
    (the tied embedding's rows), the norms whole."""
    p = program("llama-tiny", 4)
    from tilertc.driver import _tp_record

    m = {"tp": _tp_record(p), "kv_cache": {"n_kv_heads": 1, "layers": {
        "0": {"k": "layers.0.k_cache", "v": "layers.0.v_cache"}}}}
    w = random_weights(tilertc.build_graph(p.spec, SEQ), seed=3)
    hd = p.spec.head_dim
    for r in range(4):
        mine = shard_weights(m, w, r)
        pre = "model.layers.0."
        assert torch.equal(mine[pre + "self_attn.q_proj.weight"],
                           w[pre + "self_attn.q_proj.weight"][r * hd:(r + 1) * hd])
        kv = r // 2
        assert torch.equal(mine[pre + "self_attn.k_proj.weight"],
                           w[pre + "self_attn.k_proj.weight"][kv * hd:(kv + 1) * hd])
        assert torch.equal(mine[pre + "self_attn.o_proj.weight"],
                           w[pre + "self_attn.o_proj.weight"][:, r * hd:(r + 1) * hd])
        q = w[pre + "mlp.down_proj.weight"].shape[1] // 4
        assert torch.equal(mine[pre + "mlp.down_proj.weight"],
                           w[pre + "mlp.down_proj.weight"][:, r * q:(r + 1) * q])
        v = p.spec.vocab_size // 4  # tied: the packed lm_head rows; the engine embeds from w
        assert torch.equal(mine["model.embed_tokens.weight"],
                           w["model.embed_tokens.weight"][r * v:(r + 1) * v])
        assert mine[pre + "input_layernorm.weight"] is w[pre + "input_layernorm.weight"]
        cache = torch.randn(10, 2, hd)
        state = rank_state(m, {"layers.0.k_cache": cache, "layers.0.v_cache": cache}, r)
        assert torch.equal(state["layers.0.k_cache"], cache[:, kv:kv + 1])


def test_sampling_under_tp_is_refused_by_name() -> None:
    from tilertc.engine import _greedy_only
    from tilertc.ir.sampling import SamplingParams

    _greedy_only(SamplingParams(0.0, 0, 1.0, 0), 2)
    with pytest.raises(ValueError, match="sampling under --tp 2 is greedy only"):
        _greedy_only(SamplingParams(0.7, 0, 1.0, 0), 2)


def test_engine_needs_as_many_gpus_as_ranks() -> None:
    if torch.cuda.is_available() and torch.cuda.device_count() >= 8:
        pytest.skip("this machine has the GPUs")
    with pytest.raises(ArtifactError, match="compiled for --tp 8: it runs on 8 GPUs from "
                                            "cuda:0, and this machine has"):
        rank_devices(8, torch.device("cuda", 0))


# -- decode steps of every rank, on the host -----------------------------------------------------

# (model, overrides, tp, target SMs, prefill): GQA with a KV head per rank and with KV heads
# replicated on two ranks (tp 4 over 2 KV heads); MLA (the latent cache whole on every rank);
# MoE with expert parallelism (Qwen3-MoE: 4 and 2 experts per rank; DeepSeek's, with its shared
# expert split like the dense MLP, after a dense layer, on the H200 and on 5 SMs: down tasks of
# many rows); FP8 weights cut with their scales (the aligned DeepSeek variant). Qwen3-MoE with
# every expert chosen: each rank's 4 slots always busy, so its gate/up is tiled as at tp 1
# (passes/tiling.py: routed_tasks_per_slot; on 7 SMs one task of 32 rows per slot).
STEPS = [("llama-tiny", {}, 2, 132, 40), ("llama-tiny", {}, 4, 7, 100),
         ("deepseek-v3-tiny", DENSE, 2, 132, 20),
         ("qwen3-moe-tiny", {}, 2, 132, 30), ("qwen3-moe-tiny", {}, 4, 7, 60),
         ("qwen3-moe-tiny", {"num_experts_per_tok": 8}, 2, 7, 40),
         ("deepseek-v3-tiny", {}, 2, 132, 20), ("deepseek-v3-tiny", {}, 2, 5, 50),
         ("deepseek-v3-tiny", {**ALIGNED, **FP8}, 2, 132, 20),
         ("deepseek-v3-tiny", {**ALIGNED, **FP8}, 2, 7, 40)]


@pytest.mark.parametrize("name, overrides, tp, sms, prefill", STEPS)
def test_every_ranks_step_on_the_host_is_the_unsharded_interpreters(
        tmp_path: Path, name: str, overrides: dict, tp: int, sms: int, prefill: int) -> None:
    """Every rank's decode step through the device library's own code (its shard's tasks, its
    exchanges with the other ranks' arenas) against the interpreter's step of the whole model on the
    same weights: the all-reduced residual stream of every layer is bit-identical on every rank and
    equals the interpreter's up to reassociation; the logits (every rank's vocabulary rows) and
    the token, which every rank picks, are the interpreter's."""
    import dataclasses

    from tilertc.ir.target import get_target

    spec = tilertc.load_spec(name, overrides=overrides or None)
    target = dataclasses.replace(get_target("h200"), name=f"h200-{sms}", num_sms=sms)
    p = make_program(spec, target, tp=tp, max_seq_len=SEQ, tuning={"compute_warps": 4})
    weights = random_weights(tilertc.build_graph(spec, SEQ), seed=prefill)
    gen = torch.Generator().manual_seed(prefill)
    prompt = torch.randint(0, spec.vocab_size, (prefill,), generator=gen)
    token = int(torch.randint(0, spec.vocab_size, (1,), generator=gen))
    if overrides.get("num_experts_per_tok") == 8:  # every slot busy on every rank
        assert all(op.attrs["tile"]["busy"] == 1 and op.attrs["tile"]["tasks_per_slot"] == 1
                   for op in p.graph.ops() if op.opcode == "moe_gate_up")
    got, bufs, env, _ = host_step(tmp_path, p, weights, prompt, token)
    for layer in range(spec.num_layers):
        for part in ("x.attn", "x.ffn"):
            key = f"layers.{layer}.{part}"
            for r, rank in enumerate(bufs["ranks"][1:], 1):
                assert torch.equal(rank[key], bufs[key]), f"{key}: rank {r} differs from rank 0"
            want = env[key][0]
            tol = 1e-4 * float(want.abs().max())
            assert torch.allclose(bufs[key], want, rtol=1e-4, atol=tol), (
                f"{key}: max difference {float((bufs[key] - want).abs().max()):.3g}")
    logits = env["logits"][0]
    assert torch.allclose(bufs["logits"], logits, rtol=1e-4, atol=1e-4 * float(logits.abs().max()))
    assert got == int(logits.argmax())
    if spec.moe is not None:
        check_local_routes(spec, tp, bufs, env)


def check_local_routes(spec: Any, tp: int, bufs: dict, env: dict) -> None:
    """Every MoE layer's slots on every rank: the interpreter's chosen experts that the rank
    holds, best first, as indices among its own, then -1 (the seeds give ranks with every slot
    busy and ranks with none: down tasks of the shared piece only, or of nothing)."""
    local = spec.moe.num_experts // tp
    for key in (k for k in env if k.endswith("moe.expert_ids")):
        want = env[key][0].tolist()
        for r, rank in enumerate(bufs["ranks"]):
            mine = [e - r * local for e in want if r * local <= e < (r + 1) * local]
            slots = min(spec.moe.experts_per_token, local)
            got = rank[key].view(torch.int32)[:slots].tolist()
            assert got == mine + [-1] * (slots - len(mine)), f"{key}: rank {r} has {got}"


def test_tilelang_backend_refuses_tp() -> None:
    from tilertc.backends.tilelang.emit import emit

    with pytest.raises(ScheduleError, match="--tp 2: tensor parallelism is not yet in the "
                                            "TileLang backend"):
        emit(make_program(tilertc.load_spec("llama-tiny"), tp=2, max_seq_len=64))
