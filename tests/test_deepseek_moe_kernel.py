"""DeepSeek-V3's MoE in the CUDA backend, on the CPU: the router's constants, the artifact
(dense first layers, MoE layers with a shared expert, MLA attention in one kernel, no spills),
the shared expert's rows packed where the task table points, the kernel's router run on the host
against the interpreter's routing (`ir/moe.py: route`: sigmoid scores, correction bias,
group-limited top-k), and a whole decode step of the kernel's own device code run on the host
(tests/host_kernel.cpp: `step`) against the interpreter, with bf16 and FP8 weights (the shared
expert's down piece an FP8 row with its own scales): logits, token, every MoE layer's expert
ids and combine weights.

The kernel against the interpreter on a GPU is in tests/test_cuda_kernel.py (deepseek-v3-tiny).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_fp8_kernel import needs_nvcc
from test_mla_kernel import assert_step_matches, random_host_step, small
from test_moe_kernel import (
    ROUTER_WARPS,
    TOOL,
    assert_routes_match,
    columns,
    concentrated,
    routed_tiling,
    router_constants,
)
from test_sampling import bits, build_host_kernel, run_host_kernel

import tilertc
from tilertc.backends.cuda import codegen, encode
from tilertc.backends.cuda.encode import FIELDS, MLA_FIELDS, MOE_FIELDS, OPCODES, SHARED_FIELDS
from tilertc.driver import CompileOptions, compile
from tilertc.engine import pack_weights
from tilertc.ir.moe import route
from tilertc.ir.weights import random_weights
from tilertc.model_specs.hf import with_weight_dtype
from tilertc.passes.program import ScheduleError


def test_codegen_compiles_deepseek_routing_only_for_it() -> None:
    ds = codegen.constants(tilertc.schedule(tilertc.load_spec("deepseek-v3-tiny")))
    assert {k: v for k, v in ds.items() if k.startswith("MOE")} == {
        "MOE": 1, "MOE_EXPERTS": 8, "MOE_TOP_K": 2, "MOE_NORM_TOPK_PROB": 1,
        "MOE_SCALING": "2.5f", "MOE_SIGMOID": 1, "MOE_BIAS": 1, "MOE_GROUPS": 4,
        "MOE_TOPK_GROUP": 2, "MOE_SHARED_K": 32, "MOE_SLOT_K": 32}
    assert ds["MLA"] == 1
    qwen = codegen.constants(tilertc.schedule(tilertc.load_spec("qwen3-moe-tiny")))
    assert {k: qwen[k] for k in ("MOE_SIGMOID", "MOE_BIAS", "MOE_GROUPS", "MOE_TOPK_GROUP",
                                 "MOE_SHARED_K", "MOE_SLOT_K")} == {
        "MOE_SIGMOID": 0, "MOE_BIAS": 0, "MOE_GROUPS": 1, "MOE_TOPK_GROUP": 1, "MOE_SHARED_K": 0,
        "MOE_SLOT_K": 32}


@pytest.mark.parametrize("attr, what", [("shared_intermediate", "shared experts"),
                                        ("intermediate_size", "expert widths")])
def test_codegen_refuses_moe_layers_of_different_widths(attr: str, what: str) -> None:
    """The kernel takes every MoE layer's shared expert and expert width as constants
    (MOE_SHARED_K, MOE_SLOT_K); a model whose layers differ is refused by name."""
    program = tilertc.schedule(tilertc.load_spec("deepseek-v3-tiny"))
    down = next(op for op in program.graph.ops() if op.opcode == "moe_down_add")
    down.attrs[attr] += 16
    with pytest.raises(ScheduleError, match=f"MoE layers with different {what}"):
        codegen.constants(program)


def test_encoding_refuses_head_rows_past_the_kernels_head_division() -> None:
    """decode/shared.cuh's Divisor is exact while a row index times the divisor stays under
    2^32: a head_matvec past that is refused by name, not divided wrongly."""
    program = tilertc.schedule(tilertc.load_spec("deepseek-v3-tiny"))
    op = next(op for op in program.graph.ops() if op.opcode == "head_matvec")
    task = program.tasks_of(op.name)[0]
    encode.encode_task(program, task)  # as scheduled: fine
    op.attrs["rows_per_head"] = -(-(1 << 32) // program.graph.tensors[op.inputs[1]].shape[0])
    with pytest.raises(ScheduleError, match="32-bit head division"):
        encode.encode_task(program, task)


def test_deepseek_artifacts_compile_without_spills(tmp_path: Path) -> None:
    """deepseek-v3-tiny (one dense layer, two MoE layers, MLA) as built in, and full-size
    DeepSeek-V3 with one dense and one MoE layer (256 experts in 8 groups, a 2048-wide shared
    expert): one checked kernel each, no spills, the MoE, shared-expert and MLA fields."""
    needs_nvcc()
    full = {"model_type": "deepseek_v3", "num_hidden_layers": 2, "first_k_dense_replace": 1,
            "quantization_config": None}
    for name, spec, moe_layers in (
            ("tiny", tilertc.load_spec("deepseek-v3-tiny"), 2),
            ("full", tilertc.load_spec("deepseek-v3.2", overrides=full), 1)):
        out = compile(spec, tmp_path / name, CompileOptions(max_seq_len=512))
        assert subprocess.run([sys.executable, str(TOOL), str(out)]).returncode == 0
        col, m = columns(out)
        assert m["task_fields"] == [*FIELDS, *MOE_FIELDS, *SHARED_FIELDS, *MLA_FIELDS]
        assert m["kernel"]["ptxas"].get("spill_stores", 0) == 0, m["kernel"]["ptxas"]
        assert m["kernel"]["ptxas"].get("stack_bytes", 0) == 0, m["kernel"]["ptxas"]
        assert (col["opcode"] == OPCODES["moe_topk"]).sum() == moe_layers
        down = col["opcode"] == OPCODES["moe_down_add"]
        assert (col["shared_in"][down] > 0).all() and (col["shared_in"][~down] == 0).all()


def test_shared_expert_rows_are_packed_where_the_down_tasks_read_them() -> None:
    """Every down task's static rows (shared_lo/shared_hi) are its rows of the shared expert's
    down projection; the routed rows still lie at w_lo/w_hi in expert 0's part of the region."""
    from tilertc.driver import manifest

    spec = tilertc.load_spec("deepseek-v3-tiny")
    program = tilertc.schedule(spec, max_seq_len=64)
    m = manifest(program, CompileOptions(max_seq_len=64), codegen.constants(program), {}, "")
    weights = random_weights(tilertc.build_graph(spec, 64), seed=6)
    packed = pack_weights(m["weights"], weights, torch.device("cpu"))
    from tilertc.backends.cuda.encode import encode

    tasks = encode(program)[0]
    col = {name: tasks[:, i] for i, name in enumerate(m["task_fields"])}
    seen = 0
    for i in np.flatnonzero(col["opcode"] == OPCODES["moe_down_add"]):
        layer = int(program.tasks[i].op.split(".")[1])
        r0, r1 = int(col["row0"][i]), int(col["row1"][i])
        at = ((int(col["shared_hi"][i]) << 32) | (int(col["shared_lo"][i]) & 0xFFFFFFFF)) * 16
        want = weights[f"model.layers.{layer}.mlp.shared_experts.down_proj.weight"][r0:r1]
        got = packed[at: at + want.numel() * 2].view(torch.bfloat16)
        assert torch.equal(got, want.reshape(-1)), f"task {i}"
        base = ((int(col["w_hi"][i]) << 32) | (int(col["w_lo"][i]) & 0xFFFFFFFF)) * 16
        expert0 = weights[f"model.layers.{layer}.mlp.experts.0.down_proj.weight"][r0:r1]
        assert torch.equal(packed[base: base + expert0.numel() * 2].view(torch.bfloat16),
                           expert0.reshape(-1))
        seen += 1
    assert seen == 2 * 64  # MoE layers x down tasks (one row each on the H200)


# -- the router, run on the host ---------------------------------------------------------------

# (experts, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor): deepseek-v3-tiny,
# DeepSeek-V3, GLM-5 (one group), groups of 12 (the router pads each to 16 slots), unnormalized,
# and groups of 40 (padded to 64 slots: two warps' worth, the second mostly empty)
ROUTERS = [(8, 2, 4, 2, True, 2.5), (256, 8, 8, 4, True, 2.5), (256, 8, 1, 1, True, 2.5),
           (96, 6, 8, 3, False, 1.0), (160, 6, 4, 2, True, 1.0)]


def router_cases(experts: int, k: int, groups: int, gen: torch.Generator
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(logits, bias) pairs: random; exact ties of the selection values at the k-th place
    (equal logits and biases); near-ties there (equal logits, biases 2^-20 apart, ~16 float32
    steps of the selection values); a few values of each (equal selection values within and
    across the router's chunks of 32 experts, and tied groups); the k best all in the last
    chunk; two groups alike, so that their group scores tie exactly where groups are chosen;
    all equal; one NaN logit."""
    def rand() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(experts, generator=gen) * 2, torch.rand(experts, generator=gen) * 0.1

    cases = [rand() for _ in range(30)]
    cases += [(torch.randint(-1, 2, (experts,), generator=gen).float(),
               torch.randint(0, 2, (experts,), generator=gen) * 0.0625) for _ in range(10)]
    cases += [(concentrated(x, k), b) for x, b in (rand() for _ in range(5))]
    for near in (0.0, 2.0 ** -20):
        for _ in range(10):
            x, b = rand()
            order = (x.sigmoid() + b).argsort(descending=True)
            tied = order[k - 1:k + 2]
            x[tied] = float(x[order[k - 1]])
            b[tied] = float(b[order[k - 1]]) + near * torch.arange(3.0)[torch.randperm(3)]
            cases.append((x, b))
    if groups > 1:
        per = experts // groups
        for _ in range(10):
            x, b = rand()
            g0, g1 = torch.randperm(groups, generator=gen)[:2].tolist()
            x[g1 * per:(g1 + 1) * per] = x[g0 * per:(g0 + 1) * per]
            b[g1 * per:(g1 + 1) * per] = b[g0 * per:(g0 + 1) * per]
            cases.append((x, b))
    cases.append((torch.zeros(experts), torch.zeros(experts)))
    x, b = rand()
    x[3] = float("nan")
    cases.append((x, b))
    return cases


@pytest.mark.parametrize("warps", ROUTER_WARPS)
@pytest.mark.parametrize("experts, k, groups, topk_group, norm, scaling", ROUTERS)
def test_kernel_deepseek_router_is_the_interpreters(tmp_path: Path, experts: int, k: int,
                                                    groups: int, topk_group: int, norm: bool,
                                                    scaling: float, warps: int) -> None:
    """Expert ids exactly (best first; equal values: the lower expert first; groups with equal
    scores: the lower group first) and combine weights to float32 rounding, on 2 and 16 compute
    warps."""
    exe = build_host_kernel(tmp_path, 256, 4, warps, router_constants(
        experts, k, norm, scaling, deepseek=True, groups=groups, topk_group=topk_group))
    cases = router_cases(experts, k, groups, torch.Generator().manual_seed(experts + groups))
    attrs = {"scoring": "sigmoid", "n_group": groups, "topk_group": topk_group, "top_k": k,
             "norm_topk_prob": norm, "routed_scaling_factor": scaling}
    lines = run_host_kernel(exe, [f"route {bits(x.numpy())} {bits(b.numpy())}"
                                  for x, b in cases])
    for (x, b), line in zip(cases, lines, strict=True):
        out = [int(v) for v in line.split()]
        got_w = np.array(out[k:], dtype=np.uint32).view(np.float32)
        ids, w = route(x[None].float(), b.float(), attrs)
        assert out[:k] == ids[0].tolist(), f"logits {x.tolist()}, bias {b.tolist()}"
        assert np.allclose(got_w, w[0].numpy(), rtol=1e-5, atol=1e-7, equal_nan=True)


@pytest.mark.parametrize("warps", ROUTER_WARPS)
@pytest.mark.parametrize("experts, k, groups, topk_group", [(160, 6, 8, 3), (256, 8, 4, 2)])
def test_kernel_softmax_router_with_groups_is_the_interpreters(
        tmp_path: Path, experts: int, k: int, groups: int, topk_group: int, warps: int) -> None:
    """Softmax scores under a group limit and no bias (DeepSeek-V2's kind of router; groups of
    20, and of 64 over two warps): the warps' softmax sums and the groups' two best values share
    the router's scratch."""
    exe = build_host_kernel(tmp_path, 256, 4, warps, router_constants(
        experts, k, True, 1.0, groups=groups, topk_group=topk_group))
    cases = [x for x, _ in router_cases(experts, k, groups, torch.Generator().manual_seed(experts))]
    attrs = {"scoring": "softmax", "n_group": groups, "topk_group": topk_group, "top_k": k,
             "norm_topk_prob": True, "routed_scaling_factor": 1.0}
    lines = run_host_kernel(exe, [f"route {bits(x.numpy())}" for x in cases])
    for x, line in zip(cases, lines, strict=True):
        out = [int(v) for v in line.split()]
        ids, w = route(x[None].float(), None, attrs)
        assert out[:k] == ids[0].tolist(), f"logits {x.tolist()}"
        assert np.allclose(np.array(out[k:], dtype=np.uint32).view(np.float32), w[0].numpy(),
                           rtol=1e-5, atol=1e-7, equal_nan=True)


def test_group_limits_change_the_choice() -> None:
    """The group cases above are not vacuous: on them, route() without the group limit picks
    other experts at least sometimes (deepseek-v3-tiny's router)."""
    gen = torch.Generator().manual_seed(12)
    attrs = {"scoring": "sigmoid", "n_group": 4, "topk_group": 2, "top_k": 2,
             "norm_topk_prob": True, "routed_scaling_factor": 2.5}
    changed = sum(
        route(x[None], b, attrs)[0].tolist() != route(x[None], b, {**attrs, "n_group": 1,
                                                                  "topk_group": 1})[0].tolist()
        for x, b in router_cases(8, 2, 4, gen))
    assert changed >= 5


# -- a decode step of the device code, run on the host ---------------------------------------

# (weights, spec overrides, target, prompt length): deepseek-v3-tiny as built in on the H200
# (one row per task); on 5 SMs (routed tasks of several rows, several rows of gathered pieces
# per page); one expert per token from one group and two shared experts (a shared piece twice
# as wide as a routed one; a down task of one routed slot still gathers) on 7 SMs. With FP8
# weights (every piece of a down row an FP8 row with its own scales, the shared expert's too):
# as built in, and with two shared experts on 7 SMs.
ONE_SLOT_TWO_SHARED = {"num_experts_per_tok": 1, "n_group": 1, "topk_group": 1,
                       "n_shared_experts": 2}
# (weights, overrides, target, prompt length, what the routed gate/up covers: every slot busy,
# #SMs // slots tasks per slot, at most its 32 rows): on the H200 32 tasks of a row per slot;
# on 5 SMs 2 of 16 rows; one slot on 7 SMs, 7 of 4-5 rows; 4 slots on 3 SMs (fewer SMs than
# slots), one task of 32 rows per slot, two on one SM.
ONE_ROW = {"tasks_per_slot": 32, "rows": 1, "pages": 1, "per_sm": 1}
ONE_SLOT = {"tasks_per_slot": 7, "rows": 5, "pages": 1, "per_sm": 1}
STEPS = [("bf16", {}, "h200", 20, ONE_ROW),
         ("bf16", {}, small("h200-5", 5), 120,
          {"tasks_per_slot": 2, "rows": 16, "pages": 1, "per_sm": 1}),
         ("bf16", ONE_SLOT_TWO_SHARED, small("h200-7", 7), 60, ONE_SLOT),
         ("bf16", {"num_experts_per_tok": 4}, small("h200-3", 3), 70,
          {"tasks_per_slot": 1, "rows": 32, "pages": 1, "per_sm": 2}),
         ("fp8", {}, "h200", 20, ONE_ROW),
         ("fp8", ONE_SLOT_TWO_SHARED, small("h200-7", 7), 60, ONE_SLOT)]


@pytest.mark.parametrize("dtype, overrides, target, prefill, covers", STEPS)
def test_kernel_step_with_deepseek_moe_on_the_host_is_the_interpreters(
        tmp_path: Path, dtype: str, overrides: dict[str, Any], target: Any,
        prefill: int, covers: dict[str, int]) -> None:
    """One decode step of the device library's own code, dense first layer, MoE layers (router,
    routed experts fetched by the loader's route_pieces / copy_pieces, shared expert) and MLA
    attention, from the task table, packed weights and arenas, against the interpreter (bf16
    cache as the kernel's) on bf16 or FP8 weights: every MoE layer's expert ids exactly and
    combine weights, every layer's residual stream, the logits and the token."""
    spec = with_weight_dtype(tilertc.load_spec("deepseek-v3-tiny", overrides=overrides), dtype)
    program, got_tok, bufs, env, _ = random_host_step(tmp_path, spec, target, prefill)
    assert routed_tiling(program) == covers
    assert assert_routes_match(program, bufs, env) == [1, 2]
    assert_step_matches(bufs, env, got_tok, spec.num_layers, ("x.attn", "x.ffn"))
