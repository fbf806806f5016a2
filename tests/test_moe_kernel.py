"""Qwen3-MoE in the CUDA backend, on the CPU: what the codegen accepts and refuses, the MoE
artifacts (task table, weight layout), the packed experts walked from the task table, the
kernel's router run on the host against the interpreter's routing (`ir/moe.py: route`), and a
whole decode step of the kernel's own device code run on the host (tests/host_kernel.cpp:
`step`) with the routed gate/up tiled as every slot busy tiles it (passes/tiling.py:
`routed_tasks_per_slot`) on several SM counts.

The kernel against the interpreter on a GPU (logits, token loop, routing decisions per layer
and step) is in tests/test_cuda_kernel.py.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from test_fp8_kernel import needs_nvcc
from test_sampling import bits, build_host_kernel, run_host_kernel

import tilertc
from tilertc.artifact import read_manifest
from tilertc.backends.cuda import codegen
from tilertc.backends.cuda.encode import EPILOGUES, FIELDS, MOE_FIELDS, OPCODES
from tilertc.cli import main
from tilertc.engine import pack_weights
from tilertc.ir.moe import route
from tilertc.ir.weights import random_weights
from tilertc.model_specs.hf import with_weight_dtype
from tilertc.passes.program import Program, ScheduleError
from tilertc.passes.tiling import row_bytes

TOOL = Path(__file__).parents[1] / "tools" / "check_artifact.py"


# -- what the codegen takes ----------------------------------------------------------------------

def test_codegen_takes_qwen3_moe_and_compiles_moe_code_only_for_it() -> None:
    moe = codegen.constants(tilertc.schedule(tilertc.load_spec("qwen3-moe-tiny")))
    assert {k: moe[k] for k in ("MOE", "MOE_EXPERTS", "MOE_TOP_K", "MOE_NORM_TOPK_PROB")} == {
        "MOE": 1, "MOE_EXPERTS": 8, "MOE_TOP_K": 2, "MOE_NORM_TOPK_PROB": 1}
    dense = codegen.constants(tilertc.schedule(tilertc.load_spec("llama-tiny")))
    assert dense["MOE"] == 0 and not any(k.startswith("MOE_") for k in dense)


@pytest.mark.parametrize("op, attrs, message", [
    ("layers.0.moe.topk", {"scoring": "sqrtsoftplus"}, "sqrtsoftplus router scores"),
    ("layers.0.moe.topk", {"n_group": 64, "topk_group": 2}, "more than 32 expert groups"),
    ("layers.0.moe.topk", {"num_experts": 512}, "more than 256 experts"),
    ("layers.0.moe.down_proj", {"shared_intermediate": 20}, "shared expert rows that are not"),
    ("layers.1.moe.down_proj", {"intermediate_size": 20}, "expert rows that are not whole"),
])
def test_routing_the_kernel_lacks_is_refused_by_name(op: str, attrs: dict[str, Any],
                                                     message: str) -> None:
    program = tilertc.schedule(tilertc.load_spec("qwen3-moe-tiny"))
    program.graph.op(op).attrs.update(attrs)
    with pytest.raises(ScheduleError, match=f"op '{op}': not yet in the CUDA backend: {message}"):
        codegen.check_supported(program)


# -- the artifacts -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    needs_nvcc()
    out = tmp_path_factory.mktemp("qwen3-moe-tiny")
    result = CliRunner().invoke(main, ["compile", "qwen3-moe-tiny", "-o", str(out),
                                       "--max-seq-len", "64"])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module", params=["bf16", "fp8"])
def tiny_any(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
             tiny: Path) -> Path:
    """qwen3-moe-tiny with bf16 weights, and with FP8 e4m3 block-scaled ones."""
    if request.param == "bf16":
        return tiny
    out = tmp_path_factory.mktemp("qwen3-moe-tiny-fp8")
    result = CliRunner().invoke(main, ["compile", "qwen3-moe-tiny", "-o", str(out),
                                       "--max-seq-len", "64", "--weight-dtype", "fp8"])
    assert result.exit_code == 0, result.output
    return out


def columns(artifact: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The task table by field name, and the manifest."""
    m = read_manifest(artifact)
    tasks = np.load(artifact / "schedule.npz")["tasks"]
    return {name: tasks[:, i] for i, name in enumerate(m["task_fields"])}, m


def test_moe_artifact_is_checked_and_its_routed_tasks_name_their_router(tiny: Path) -> None:
    assert subprocess.run([sys.executable, str(TOOL), str(tiny)]).returncode == 0
    col, m = columns(tiny)
    assert m["task_fields"] == [*FIELDS, *MOE_FIELDS]
    assert "#define MOE 1" in (tiny / "kernel.cu").read_text()
    counters = m["counters"]
    for layer in (0, 1):
        topk = counters.index(f"layers.{layer}.moe.topk")
        ids = m["buffers"][f"layers.{layer}.moe.expert_ids"]["offset"]
        weights = m["buffers"][f"layers.{layer}.moe.expert_weights"]["offset"]
        gate_up = col["signal"] == counters.index(f"layers.{layer}.moe.gate_up")
        down = col["signal"] == counters.index(f"layers.{layer}.moe.down_proj")
        assert (col["opcode"][gate_up] == OPCODES["moe_gate_up"]).all()
        assert (col["epilogue"][gate_up] == EPILOGUES["silu_mul"]).all()
        assert (col["epilogue"][down] == EPILOGUES["none"]).all()
        assert (col["opcode"][down] == OPCODES["moe_down_add"]).all()
        for sel in (gate_up, down):
            assert (col["route"][sel] == topk).all() and (col["ids"][sel] == ids).all()
        # qwen3-moe-tiny: 2 slots of 32 rows; a gate/up task reads its slot, a down task both
        assert (col["slot0"][gate_up] == col["row0"][gate_up] // 32).all()
        assert (col["slots"][gate_up] == 1).all() and (col["slots"][down] == 2).all()
        assert (col["aux2"][down] == weights).all()
        assert (col["row_bytes"][down] == 2 * 32 * 2).all()  # both slots' down rows side by side
    assert (col["route"][col["opcode"] < OPCODES["moe_topk"]] == -1).all()
    experts = [e for e in m["weights"]["layout"] if "expert" in e]
    assert len(experts) == 2 * 2 * 8  # layers x routed ops x experts
    assert m["weights"]["packed_bytes"] == max(e["offset"] + e["bytes"] for e in experts)


def test_full_size_qwen3_30b_a3b_compiles(tmp_path: Path) -> None:
    needs_nvcc()
    result = CliRunner().invoke(main, ["compile", "qwen3-30b-a3b", "-o", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert subprocess.run([sys.executable, str(TOOL), str(tmp_path)]).returncode == 0
    col, m = columns(tmp_path)
    # the experts lie beyond 32 GiB: offsets / 16 use the low word's top bit (read unsigned)
    offsets = ((col["w_hi"].astype(np.int64) << 32) | (col["w_lo"].astype(np.int64) & 0xFFFFFFFF))
    assert m["weights"]["packed_bytes"] > 2**35 and (col["w_lo"] < 0).any()
    assert offsets.max() * 16 < m["weights"]["packed_bytes"]


def test_packed_experts_follow_the_task_table(tiny: Path) -> None:
    """Walk every routed task of the table and, for every expert a slot could be routed to,
    find that expert's rows where the kernel's loader computes them (the task's weights +
    expert x stride): gate and up rows interleaved, down rows one slot's piece of each row."""
    col, m = columns(tiny)
    weights = random_weights(tilertc.build_graph(tilertc.load_spec("qwen3-moe-tiny"), 64), seed=3)
    packed = pack_weights(m["weights"], weights, torch.device("cpu"))
    inter, walked = 32, 0
    layer_of = {i: int(name.split(".")[1]) for i, name in enumerate(m["counters"])
                if name.startswith("layers.")}
    for i in np.flatnonzero(col["opcode"] >= OPCODES["moe_gate_up"]):
        base = ((int(col["w_hi"][i]) << 32) | (int(col["w_lo"][i]) & 0xFFFFFFFF)) * 16
        row0, row1, rb = int(col["row0"][i]), int(col["row1"][i]), int(col["row_bytes"][i])
        piece = rb // int(col["slots"][i])
        prefix = f"model.layers.{layer_of[int(col['signal'][i])]}.mlp.experts"
        for e in range(8):
            at = base + e * int(col["expert_stride"][i]) * 16
            if col["opcode"][i] == OPCODES["moe_gate_up"]:
                r0, r1 = row0 % inter, row0 % inter + row1 - row0
                gate, up = (weights[f"{prefix}.{e}.{p}.weight"][r0:r1]
                            for p in ("gate_proj", "up_proj"))
                want = torch.stack([gate, up], 1).reshape(-1)
            else:
                want = weights[f"{prefix}.{e}.down_proj.weight"][row0:row1].reshape(-1)
            got = packed[at: at + (row1 - row0) * piece].view(torch.bfloat16)
            assert torch.equal(got, want), f"task {i}, expert {e}"
            walked += 1
    assert walked == 8 * 2 * (64 + 64)  # experts x layers x (gate/up tasks + down tasks)


# -- the router, run on the host ---------------------------------------------------------------

# (experts, top_k, norm_topk_prob, routed_scaling_factor): qwen3-moe-tiny, Qwen3-30B-A3B, and
# a count that leaves lanes without a last expert, unnormalized and scaled
ROUTERS = [(8, 2, True, 1.0), (128, 8, True, 1.0), (60, 4, False, 2.5)]


def router_constants(experts: int, k: int, norm: bool, scaling: float, deepseek: bool = False,
                     groups: int = 1, topk_group: int = 1) -> dict[str, object]:
    """codegen's MOE_* constants of a router: Qwen3-MoE's, or DeepSeek's (sigmoid scores, a
    correction bias, groups)."""
    return {"MAX_K": 3 * experts + 2 * k + groups,  # s.vec: room for what the router stages
            "MOE_EXPERTS": experts, "MOE_TOP_K": k, "MOE_NORM_TOPK_PROB": int(norm),
            "MOE_SCALING": f"{scaling!r}f", "MOE_SIGMOID": int(deepseek),
            "MOE_BIAS": int(deepseek), "MOE_GROUPS": groups, "MOE_TOPK_GROUP": topk_group}


# The router's compute warps on the host: 2 (a thread holds several of the router's slots) and
# 16 (one slot a thread, as the kernel is built).
ROUTER_WARPS = [2, 16]


def concentrated(x: torch.Tensor, k: int) -> torch.Tensor:
    """x with the k best values on k consecutive experts of its last 32, in one of the router's
    chunks of 32 slots (whose candidates are then the whole choice)."""
    x = x.clone()
    x[(len(x) - 1) // 32 * 32:][:k] += 10
    return x


@pytest.mark.parametrize("warps", ROUTER_WARPS)
@pytest.mark.parametrize("experts, k, norm, scaling", ROUTERS)
def test_kernel_router_is_the_interpreters(tmp_path: Path, experts: int, k: int, norm: bool,
                                           scaling: float, warps: int) -> None:
    """Expert ids exactly (best first; equal scores: the lower expert first) and combine weights
    to float32 rounding, on random logits and on logits with planted exact ties at the top-k
    boundary, logits of a few values (ties within and across the router's chunks of 32
    experts), the best all in one chunk, a chunk of -inf logits, all-equal logits, and a NaN."""
    exe = build_host_kernel(tmp_path, 256, 4, warps, router_constants(experts, k, norm, scaling))
    gen = torch.Generator().manual_seed(experts)
    cases = [torch.randn(experts, generator=gen) * 3 for _ in range(20)]
    for _ in range(10):  # ties straddling the k-th place
        x = torch.randn(experts, generator=gen)
        order = x.argsort(descending=True)
        x[order[k:k + 3]] = float(x[order[k - 1]])
        cases.append(x)
    cases += [torch.randint(-2, 3, (experts,), generator=gen).float() for _ in range(10)]
    cases += [concentrated(torch.randn(experts, generator=gen), k) for _ in range(5)]
    if experts > 32:  # a chunk of zero scores (on 16 warps, a warp's maximum -inf)
        cases.append(torch.randn(experts, generator=gen))
        cases[-1][:32] = float("-inf")
    cases.append(torch.zeros(experts))
    cases.append(torch.randn(experts, generator=gen))
    cases[-1][3] = float("nan")  # every score NaN: the ids must still be valid for the loader
    attrs = {"scoring": "softmax", "n_group": 1, "topk_group": 1, "top_k": k,
             "norm_topk_prob": norm, "routed_scaling_factor": scaling}
    lines = run_host_kernel(exe, [f"route {bits(x.numpy())}" for x in cases])
    for x, line in zip(cases, lines, strict=True):
        out = [int(v) for v in line.split()]
        got_w = np.array(out[k:], dtype=np.uint32).view(np.float32)
        ids, w = route(x[None].float(), None, attrs)
        assert out[:k] == ids[0].tolist(), f"logits {x.tolist()}"
        assert np.allclose(got_w, w[0].numpy(), rtol=1e-5, atol=1e-7, equal_nan=True)


def test_tilelang_backend_refuses_moe_experts() -> None:
    from tilertc.backends.tilelang.emit import emit

    with pytest.raises(ScheduleError, match="'layers.0.moe.gate_up': MoE experts are not yet in "
                                            "the TileLang backend"):
        emit(tilertc.schedule(tilertc.load_spec("qwen3-moe-tiny")))


def test_routed_tasks_read_from_the_table_compute_the_interpreters_moe_layer(
        tiny_any: Path) -> None:
    """The routed tasks of one layer done the way the device library does them, from nothing but the
    task table, the act arena and the packed weights: the loader's addresses (w + expert x
    stride, a down row gathered from every slot's piece), the staged input (RMS-normalized for
    gate/up; each slot's activations times its combine weight for down), the dot products (FP8:
    each piece's values times its own block scales) and the epilogues (silu_mul; the residual).
    The layer's output must be the interpreter's on the same (bf16 or FP8) weights."""
    col, m = columns(tiny_any)
    spec = tilertc.load_spec("qwen3-moe-tiny")
    fp8 = m["kernel"]["constants"]["WEIGHT_FP8"] == 1
    if fp8:
        spec = with_weight_dtype(spec, "fp8")
    weights = random_weights(tilertc.build_graph(spec, 64), seed=4)
    packed = pack_weights(m["weights"], weights, torch.device("cpu"))
    ref = tilertc.ir.interpreter.Interpreter(tilertc.build_graph(spec, 64), weights,
                                             torch.device("cpu"))
    env = {k: v[-1] for k, v in ref.run(torch.tensor([5, 9, 2]), torch.arange(3)).items()}
    act = torch.full((m["arenas"]["act"],), float("nan"))
    for name in ("layers.0.x.attn", "layers.0.post_attention_layernorm",
                 "layers.0.moe.expert_weights"):
        b = m["buffers"][name]
        act[b["offset"]: b["offset"] + b["numel"]] = (
            weights[b["hf_name"]].float() if b["hf_name"] else env[name])
    ids = m["buffers"]["layers.0.moe.expert_ids"]
    act[ids["offset"]: ids["offset"] + ids["numel"]] = env["layers.0.moe.expert_ids"].int().view(
        torch.float32)

    def values(raw: torch.Tensor, k: int) -> torch.Tensor:
        """Rows of packed weight bytes [n, bytes] as fp32 values: bf16, or (FP8) k e4m3 values
        then the fp32 scales of their FP8_BLOCK_COLS-column blocks."""
        if not fp8:
            return raw.contiguous().view(torch.bfloat16).float()
        cols = m["kernel"]["constants"]["FP8_BLOCK_COLS"]
        scales = raw[:, k:k + 4 * -(-k // cols)].contiguous().view(torch.float32)
        return raw[:, :k].contiguous().view(torch.float8_e4m3fn).float() * scales.repeat_interleave(
            cols, 1)[:, :k]

    def rows(i: int, piece: int, n: int, k: int, halves: int = 1) -> torch.Tensor:
        """The task's rows as the loader fetches them: piece j of every row from the expert the
        router put in slot slot0 + j; a piece holds `halves` rows of k columns (gate and up)."""
        base = ((int(col["w_hi"][i]) << 32) | (int(col["w_lo"][i]) & 0xFFFFFFFF)) * 16
        chosen = act[col["ids"][i] + col["slot0"][i]:][:col["slots"][i]].view(torch.int32)
        parts = [packed[base + int(e) * int(col["expert_stride"][i]) * 16:][:n * piece]
                 .reshape(n * halves, piece // halves) for e in chosen]
        return torch.cat([values(part, k).reshape(n, -1) for part in parts], 1)

    counters = m["counters"]
    for op, opcode in (("gate_up", "moe_gate_up"), ("down_proj", "moe_down_add")):
        for i in np.flatnonzero(col["signal"] == counters.index(f"layers.0.moe.{op}")):
            assert col["opcode"][i] == OPCODES[opcode]
            k, n, r0 = int(col["k"][i]), int(col["row1"][i] - col["row0"][i]), int(col["row0"][i])
            x = act[col["in"][i]:][:k]
            if opcode == "moe_gate_up":
                eps = np.array(col["eps"][i], dtype=np.int32).view(np.float32)
                x = x * act[col["aux"][i]:][:k] * torch.rsqrt(x.square().mean() + float(eps))
                w = rows(i, int(col["row_bytes"][i]), n, k, halves=2)
                y = w[:, :k] @ x  # the epilogue decides whether a row is a gate/up pair
                if col["epilogue"][i] == EPILOGUES["silu_mul"]:
                    y = torch.nn.functional.silu(y) * (w[:, k:] @ x)
            else:
                slots = int(col["slots"][i])
                x = x * act[col["aux2"][i]:][:slots].repeat_interleave(k // slots)
                y = (rows(i, int(col["row_bytes"][i]) // slots, n, k // slots) @ x
                     + act[col["aux"][i] + r0:][:n])
            act[col["out"][i] + r0:][:n] = y
    out = m["buffers"]["layers.0.x.ffn"]
    got = act[out["offset"]: out["offset"] + out["numel"]]
    assert torch.allclose(got, env["layers.0.x.ffn"], rtol=1e-4, atol=1e-5)


# -- a decode step of the device code, run on the host ---------------------------------------

def routed_tiling(program: Program) -> dict[str, int]:
    """What a step's routed gate/up tasks cover: tasks per slot, the most rows of a task, the
    most ring pages one streams, and the most gate/up tasks of a layer on one SM."""
    op = next(op for op in program.graph.ops() if op.opcode == "moe_gate_up")
    tile, rows_per_page = op.attrs["tile"], program.config["page_bytes"] // row_bytes(program, op)
    rows = tile["rows_per_task"][1]
    return {"tasks_per_slot": tile["tasks_per_slot"], "rows": rows,
            "pages": -(-rows // rows_per_page),
            "per_sm": max(Counter(t.sm for t in program.tasks_of(op.name)).values())}


def assert_routes_match(program: Program, bufs: dict[str, torch.Tensor],
                        env: dict[str, torch.Tensor]) -> list[int]:
    """A host step's expert ids (exactly) and combine weights of every MoE layer against the
    interpreter's; returns the MoE layers."""
    layers = [op.layer for op in program.graph.ops() if op.opcode == "moe_topk"]
    for layer in layers:
        ids = f"layers.{layer}.moe.expert_ids"
        assert bufs[ids].view(torch.int32).tolist() == env[ids][0].tolist(), ids
        w = f"layers.{layer}.moe.expert_weights"
        assert torch.allclose(bufs[w], env[w][0], rtol=1e-5, atol=1e-7), w
    return layers


# Qwen3-30B-A3B's routing in small: 8 of 16 experts, 768 rows per slot; hidden 256 so that a
# gate/up task's rows (1 KB each) span several ring pages (no smaller than a down row, 12 KB).
WIDE = {"hidden_size": 256, "num_experts": 16, "num_experts_per_tok": 8,
        "moe_intermediate_size": 768}
# (weights, overrides, SMs, page KB, prompt length, what the routed gate/up covers): WIDE on
# the H200 with 4 KB pages (16 tasks of 48 rows per slot, one per SM, 4 pages each: the GPU
# test's variant); the tiny spec on 7 SMs (3 tasks per slot, 10-11 rows); 4 slots on 3 SMs
# (fewer SMs than slots: a slot's rows in one task, two gate/up tasks on one SM); FP8 on 5
# SMs (2 tasks per slot of 16 rows).
HOST_STEPS = [
    ("bf16", WIDE, 132, 4, 30, {"tasks_per_slot": 16, "rows": 48, "pages": 4, "per_sm": 1}),
    ("bf16", {}, 7, None, 40, {"tasks_per_slot": 3, "rows": 11, "pages": 1, "per_sm": 1}),
    ("bf16", {"num_experts_per_tok": 4}, 3, None, 50,
     {"tasks_per_slot": 1, "rows": 32, "pages": 1, "per_sm": 2}),
    ("fp8", {}, 5, None, 20, {"tasks_per_slot": 2, "rows": 16, "pages": 1, "per_sm": 1}),
]


@pytest.mark.parametrize("dtype, overrides, sms, page_kb, prefill, covers", HOST_STEPS)
def test_kernel_step_with_qwen3_moe_on_the_host_is_the_interpreters(
        tmp_path: Path, dtype: str, overrides: dict[str, Any], sms: int, page_kb: int | None,
        prefill: int, covers: dict[str, int]) -> None:
    """One decode step of the device library's own code (router, top-k, the routed gate/up tasks of
    whole row ranges of a slot fetched by the loader's route_pieces, the down tasks gathering
    every slot's piece) from the task table, packed weights and arenas, against the interpreter
    (bf16 cache as the kernel's) on bf16 or FP8 weights: every layer's expert ids and combine
    weights, every layer's residual stream, the logits and the token."""
    # imported here: test_mla_kernel imports this module
    from test_mla_kernel import assert_step_matches, random_host_step, small

    spec = with_weight_dtype(tilertc.load_spec("qwen3-moe-tiny", overrides=overrides or None),
                             dtype)
    program, got_tok, bufs, env, _ = random_host_step(
        tmp_path, spec, small(f"h200-{sms}", sms), prefill, {"page_kb": page_kb} if page_kb else {})
    assert routed_tiling(program) == covers
    assert assert_routes_match(program, bufs, env) == [0, 1]
    assert_step_matches(bufs, env, got_tok, spec.num_layers, ("x.attn", "x.ffn"))
