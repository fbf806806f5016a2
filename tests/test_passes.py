"""Each pass, before and after: what it decides, checked on the program it leaves.

Also the inputs the passes refuse (an unknown target, a --tp that does not divide the model, a
tile that does not fit shared memory) and the CUDA backend's refusals: each error names the op
or option and the limit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from tilertc import load_spec, schedule
from tilertc.backends.cuda.codegen import constants
from tilertc.ir.build import build_graph
from tilertc.ir.graph import TensorKind
from tilertc.ir.target import get_target
from tilertc.model_specs.hf import with_weight_dtype
from tilertc.passes.cost import (
    ATTENTION_CHAIN_NS,
    ATTENTION_KV_BYTES_PER_S_PER_SM,
    BOUNDARY_NS,
    DIGIT_ROUND_NS,
    FP8_ROW_STREAM_SHARE,
    MLA_CHAIN_NS,
    READY_PRODUCER_NS,
    ROUTED_DOWN_FP8_STREAM_SHARE,
    TASK_NS,
    op_times_ns,
    predicted_task_ns,
    step_ns,
)
from tilertc.passes.digits import digits_floats
from tilertc.passes.fusion import fuse
from tilertc.passes.packing import pack, static_bytes
from tilertc.passes.pipeline import PASSES, make_program
from tilertc.passes.program import Program, ScheduleError
from tilertc.passes.residency import place
from tilertc.passes.roles import assign_roles, register_cap
from tilertc.passes.scheduling import schedule as schedule_pass
from tilertc.passes.sharding import shard
from tilertc.passes.synchronization import synchronize
from tilertc.passes.tiling import (
    MATVEC,
    ROUTER_ROWS,
    beside_partner,
    has_tiles,
    router_sms,
    row_bytes,
    sms_beside,
    tile,
)


def until(name: str, last: Callable[[Program], Program], tp: int = 1, target: str = "h200",
          tuning: dict | None = None, **overrides: object) -> tuple[Program, Program]:
    """(the program before `last`, a deep copy of it; then `last` has run on the first)."""
    spec = load_spec(name, overrides)
    program = Program(spec, build_graph(spec), get_target(target), tp)
    program.config["tuning"] = dict(tuning or {})
    for run in PASSES:
        if run is last:
            before = Program(program.spec, _copy_graph(program.graph), program.target, tp,
                             [dataclasses.replace(t) for t in program.tasks],
                             [list(s) for s in program.streams], config=dict(program.config))
            return before, run(program)
        program = run(program)
    raise AssertionError(f"{last.__name__} is not in the pipeline")


def _copy_graph(g):
    from tilertc.ir.graph import Graph

    return Graph.from_dict(g.to_dict())


# -- sharding ----------------------------------------------------------------------------------

def test_sharding_tp1_changes_nothing() -> None:
    before, after = until("llama-tiny", shard)
    assert {n: t.shape for n, t in before.graph.tensors.items()} == \
           {n: t.shape for n, t in after.graph.tensors.items()}
    assert after.config["sharding"] == {"tp": 1, "allreduce_after": []}


def test_sharding_tp8_splits_heads_mlp_and_vocab_and_all_reduces_before_residuals() -> None:
    before, after = until("llama-3.1-8b", shard, tp=8)
    b, a = before.graph.tensors, after.graph.tensors
    assert b["layers.0.self_attn.q_proj"].shape == (4096, 4096)
    assert a["layers.0.self_attn.q_proj"].shape == (512, 4096)  # 4 of 32 heads
    assert a["layers.0.self_attn.k_proj"].shape == (128, 4096)  # 1 of 8 KV heads
    assert a["layers.0.self_attn.o_proj"].shape == (4096, 512)  # row-parallel
    assert a["layers.0.mlp.gate_proj"].shape == (14336 // 8, 4096)
    assert a["layers.0.mlp.down_proj"].shape == (4096, 14336 // 8)
    assert a["lm_head"].shape == (128256 // 8, 4096)
    attn = after.graph.op("layers.0.attention").attrs
    assert (attn["n_heads"], attn["n_kv_heads"]) == (4, 1)
    assert after.config["sharding"]["allreduce_after"][:2] == ["layers.0.o_proj",
                                                               "layers.0.ffn.down_proj"]
    assert len(after.config["sharding"]["allreduce_after"]) == 64


def test_sharding_replicates_kv_heads_and_splits_experts() -> None:
    _, after = until("qwen3-30b-a3b", shard, tp=8)
    assert after.graph.tensors["layers.0.self_attn.k_proj"].shape == (128, 2048)
    experts = after.graph.op("layers.0.moe.experts")
    assert len(experts.inputs) == 3 + 3 * 16 and experts.attrs["slots"] == 8
    assert "layers.0.mlp.experts.16.gate_proj" not in after.graph.tensors
    assert any("replicated on 2 ranks" in d for d in after.decisions)
    assert any("16 routed experts per rank" in d for d in after.decisions)


@pytest.mark.parametrize(("model", "tp", "overrides", "message"), [
    ("llama-3.1-8b", 3, {}, "--tp 3: number of attention heads 32 is not divisible by 3 "
                            "(op 'layers.0.q_proj')"),
    ("llama-tiny", 6, {"num_attention_heads": 12, "num_key_value_heads": 4},
     "--tp 6: 4 KV heads can neither be split over nor replicated on 6 ranks (op "
     "'layers.0.k_proj')"),
    ("qwen3-moe-tiny", 4, {"num_experts": 6},
     "--tp 4: number of routed experts 6 is not divisible by 4 (op 'layers.0.moe.experts')"),
    ("llama-tiny", 0, {}, "--tp 0: the number of GPU ranks must be at least 1"),
])
def test_a_tp_that_does_not_divide_the_model_is_refused(model: str, tp: int, overrides: dict,
                                                        message: str) -> None:
    with pytest.raises(ScheduleError) as err:
        schedule(load_spec(model, overrides), tp=tp)
    assert str(err.value) == message


# -- fusion ------------------------------------------------------------------------------------

def test_fusion_folds_the_norm_and_qkv_projections_into_one_norm_matvec() -> None:
    before, after = until("llama-tiny", fuse)
    assert [before.graph.op(n).opcode for n in ("layers.0.input_norm", "layers.0.q_proj",
                                                "layers.0.k_proj", "layers.0.v_proj")] == \
        ["rms_norm", "linear", "linear", "linear"]
    qkv = after.graph.op("layers.0.qkv_proj")
    assert qkv.opcode == "norm_matvec"
    assert qkv.attrs["fused_from"] == ["layers.0.input_norm", "layers.0.q_proj",
                                       "layers.0.k_proj", "layers.0.v_proj"]
    assert after.graph.tensors[qkv.outputs[0]].attrs["parts"] == [
        ["layers.0.q", 64], ["layers.0.k", 32], ["layers.0.v", 32]]
    assert len(before.graph.ops()) == 36 and len(after.graph.ops()) == 13
    ffn = after.graph.op("layers.0.ffn.gate_up_proj")
    assert (ffn.attrs["epilogue"], ffn.attrs["interleave"]) == ("silu_mul", True)


def test_fusion_of_moe_mla_and_dsa_blocks() -> None:
    _, after = until("glm-5-tiny", fuse)
    layer1 = [(op.name.removeprefix("layers.1."), op.opcode) for op in after.graph.ops()
              if op.layer == 1]
    assert layer1 == [
        ("attn_in_proj", "norm_matvec"), ("q_b_proj", "norm_matvec"),
        ("dsa.score", "dsa_score"), ("dsa.topk", "dsa_topk"), ("q_absorb", "head_matvec"),
        ("attention", "mla_attention"), ("v_expand", "head_matvec"), ("o_proj", "matvec_add"),
        ("moe.router", "norm_matvec"), ("moe.topk", "moe_topk"),
        ("ffn.shared_experts.gate_up_proj", "norm_matvec"), ("moe.gate_up", "moe_gate_up"),
        ("moe.down_proj", "moe_down_add")]
    q_b = after.graph.op("layers.1.q_b_proj")  # reads the q_a part of attn_in_proj
    assert q_b.inputs[0] == "layers.1.attn_in_proj" and q_b.attrs["in_offset"] == 0
    assert "layers.1.self_attn.kv_b_proj.w_uk_t" in after.graph.tensors


# -- tiling ------------------------------------------------------------------------------------

def test_tiling_gives_every_sm_the_same_bytes_of_each_matvec() -> None:
    before, after = until("llama-3.1-8b", tile)
    assert not before.tasks
    sms = after.target.num_sms
    for op in after.graph.ops():
        tasks = after.tasks_of(op.name)
        if op.opcode in MATVEC:
            sizes = [t.weight_bytes for t in tasks]
            assert len(tasks) <= sms
            assert max(sizes) - min(sizes) <= row_bytes(after, op)
            assert sum(sizes) == sum(after.graph.tensors[w].nbytes for w in op.inputs
                                     if after.graph.tensors[w].kind is TensorKind.WEIGHT
                                     and len(after.graph.tensors[w].shape) == 2)
        elif op.opcode == "attention":
            tile_ = op.attrs["tile"]
            assert len(tasks) == tile_["signals"] * tile_["chunks"] <= sms


def slot_rows(program: Program, op: str) -> list[list[tuple[int, int]]]:
    """Per slot of a routed gate/up op, its tasks' row ranges within the slot, in task order."""
    a = program.graph.op(op).attrs
    inter, per = a["intermediate_size"], a["tile"]["tasks_per_slot"]
    tasks = program.tasks_of(op)
    assert [t.index for t in tasks] == list(range(a["slots"] * per))
    out = []
    for slot in range(a["slots"]):
        mine = tasks[slot * per:(slot + 1) * per]
        assert all(t.rows[0] // inter == slot == (t.rows[1] - 1) // inter for t in mine)
        out.append([(t.rows[0] - slot * inter, t.rows[1] - slot * inter) for t in mine])
    return out


def even_split(rows: int, n: int) -> list[tuple[int, int]]:
    return [(rows * i // n, rows * (i + 1) // n) for i in range(n)]


# (model, tp, SMs, slots, rows per slot, tasks per slot): every slot busy (tp 1): #SMs // slots
# tasks per slot, about one per SM (Qwen3-30B-A3B: 16 of 48 rows; DeepSeek-V3.2: 16 of 128);
# capped by the rows (qwen3-moe-tiny: 32 rows, not 66 tasks); with fewer SMs than slots one
# task per slot. Under expert parallelism (tp 8, a slot busy with probability 1/8) every slot
# over all SMs, as before.
ROUTED_TILES = [("qwen3-30b-a3b", 1, 132, 8, 768, 16), ("deepseek-v3.2", 1, 132, 8, 2048, 16),
                ("qwen3-moe-tiny", 1, 132, 2, 32, 32), ("qwen3-moe-tiny", 1, 5, 2, 32, 2),
                ("qwen3-30b-a3b", 1, 5, 8, 768, 1), ("qwen3-30b-a3b", 8, 132, 8, 768, 132),
                ("qwen3-moe-tiny", 2, 132, 2, 32, 32), ("qwen3-moe-tiny", 2, 5, 2, 32, 5)]


@pytest.mark.parametrize("name, tp, sms, slots, inter, per", ROUTED_TILES)
def test_routed_gate_up_tasks_per_slot(name: str, tp: int, sms: int, slots: int, inter: int,
                                       per: int) -> None:
    """The tiling of a routed gate/up, before (no tasks) and after: task count, each slot's
    tasks covering its rows in order, split evenly, and the decision that says why."""
    target = dataclasses.replace(get_target("h200"), name=f"h200-{sms}", num_sms=sms)
    before, after = until(name, tile, tp=tp, target=target)
    op = next(op for op in after.graph.ops() if op.opcode == "moe_gate_up")
    assert not before.tasks_of(op.name) and "tile" not in before.graph.op(op.name).attrs
    busy = min(1.0, op.attrs["top_k"] / (tp * slots))
    lo, hi = inter // per, -(-inter // per)
    assert op.attrs["tile"] == {"tasks": slots * per, "tasks_per_slot": per, "busy": busy,
                                "rows_per_task": (lo, hi)}
    assert slot_rows(after, op.name) == [even_split(inter, per)] * slots
    assert all(not t.segments for t in after.tasks_of(op.name))
    decision = next(d for d in after.decisions if d.startswith(f"[tiling] {op.name}:"))
    assert f"-> {slots} x {per} tasks" in decision
    assert ("every slot busy" if tp == 1 else "every slot over all SMs") in decision


def test_cost_charges_each_further_task_of_an_op_on_an_sm_its_fixed_cost() -> None:
    """Qwen3-30B-A3B's gate/up at tp 1 runs one task per SM: its bytes and one boundary. At
    tp 8 each SM runs 8: each after the first adds TASK_NS times the chance its slot is busy
    (and no all-reduce: that is the down projection's)."""
    one, eight = (schedule(load_spec("qwen3-30b-a3b"), tp=tp, max_seq_len=256) for tp in (1, 8))
    for p in (one, eight):
        tasks = p.tasks_of("layers.3.moe.gate_up")
        on = {sm: [t for t in tasks if t.sm == sm] for sm in {t.sm for t in tasks}}
        busy = p.graph.op("layers.3.moe.gate_up").attrs["tile"]["busy"]
        want = max(sum(t.est_ns for t in ts) + (len(ts) - 1) * TASK_NS * busy
                   for ts in on.values())
        assert op_times_ns(p)["layers.3.moe.gate_up"] == pytest.approx(want + BOUNDARY_NS)
        assert (max(map(len, on.values())) == 1) == (p is one)


def test_cost_of_fp8_tiles_and_fp8_rows() -> None:
    """llama-3.1-8b FP8 (one layer): each tiled op costs its bytes, a boundary and a round of
    DIGIT_ROUND_NS per 64 of its 128-column input blocks (16 compute warps, 4 blocks each):
    qkv, o and gate/up 1 round, down 2 (without ready digits: test_cost_of_ready_digits). As
    rows (fp8_mma=0) no op pays that, but its bytes stream at FP8_ROW_STREAM_SHARE of the SM's
    share."""
    spec = with_weight_dtype(load_spec("llama-3.1-8b", overrides={"num_hidden_layers": 1}), "fp8")
    tiles, rows = (schedule(spec, max_seq_len=256, tuning=t)
                   for t in ({"ready_digits": False}, {"fp8_mma": False}))
    assert tiles.config["compute_warps"] == 16
    rounds = {"qkv_proj": 1, "o_proj": 1, "ffn.gate_up_proj": 1, "ffn.down_proj": 2}
    for p, tiled in ((tiles, True), (rows, False)):
        times = op_times_ns(p)
        for op, n in rounds.items():
            name = f"layers.0.{op}"
            by_sm: dict[int, float] = {}
            for t in p.tasks_of(name):
                by_sm[t.sm] = by_sm.get(t.sm, 0.0) + t.est_ns
            stream = max(by_sm.values()) / (1.0 if tiled else FP8_ROW_STREAM_SHARE)
            assert times[name] == pytest.approx(stream + BOUNDARY_NS
                                                + (n * DIGIT_ROUND_NS if tiled else 0.0))


def test_fp8_tiles_or_rows_whichever_the_cost_model_predicts_faster() -> None:
    """qwen3-30b-a3b FP8 (2 layers) is kept as rows, llama-3.1-8b FP8 (2 layers) as tiles, as
    the H200 measured the full models (docs/performance.md, session 31), each with the decision
    saying both predictions; asking for tiles or rows skips the comparison."""
    def fp8(name: str):
        return with_weight_dtype(load_spec(name, overrides={"num_hidden_layers": 2}), "fp8")

    for name, want_tiles in (("qwen3-30b-a3b", False), ("llama-3.1-8b", True)):
        spec = fp8(name)
        chosen = make_program(spec, max_seq_len=256)
        tiles, rows = (make_program(spec, max_seq_len=256, tuning={"fp8_mma": m})
                       for m in (True, False))
        assert has_tiles(tiles) and not has_tiles(rows) and has_tiles(chosen) == want_tiles
        assert (step_ns(tiles) <= step_ns(rows)) == want_tiles
        assert step_ns(chosen) == min(step_ns(tiles), step_ns(rows))
        said = [d for d in chosen.decisions if "FP8 projections as" in d]
        how = "tiles for the tensor cores" if want_tiles else "rows on the CUDA cores"
        assert said == [f"[tiling] FP8 projections as {how}: the cost model predicts "
                        f"{step_ns(tiles) / 1e6:.3f} ms a step with tiles, "
                        f"{step_ns(rows) / 1e6:.3f} with rows"]
        assert not [d for d in tiles.decisions + rows.decisions if "FP8 projections as" in d]
    assert has_tiles(make_program(fp8("qwen3-30b-a3b"), max_seq_len=256,
                                  tuning={"ready_digits": True}))


def test_cost_of_ready_digits() -> None:
    """llama-3.1-8b FP8 (two layers) with ready digits: an op that reads them pays no digit
    rounds, one that writes them READY_PRODUCER_NS; the first layer's qkv (its input from the
    embedding) still converts, its down both reads and writes."""
    spec = with_weight_dtype(load_spec("llama-3.1-8b", overrides={"num_hidden_layers": 2}), "fp8")
    base, ready = (op_times_ns(schedule(spec, max_seq_len=256, tuning=t))
                   for t in ({"ready_digits": False}, {}))
    rounds = {"qkv_proj": 1, "o_proj": 1, "ffn.gate_up_proj": 1, "ffn.down_proj": 2}
    writes = {"o_proj": 1, "ffn.gate_up_proj": 1, "ffn.down_proj": 1}
    for layer in (0, 1):
        for op, n in rounds.items():
            name = f"layers.{layer}.{op}"
            reads = op != "o_proj" and (layer, op) != (0, "qkv_proj")
            writes_here = writes.get(op, 0) * (layer == 0 or op != "ffn.down_proj")
            assert ready[name] - base[name] == pytest.approx(
                writes_here * READY_PRODUCER_NS - (n * DIGIT_ROUND_NS if reads else 0.0)), name


# -- residency ---------------------------------------------------------------------------------

def test_residency_ring_satisfies_littles_law_and_fits_shared_memory() -> None:
    _, after = until("llama-3.1-8b", place)
    cfg, tgt = after.config, after.target
    in_flight = cfg["ring_pages"] * cfg["page_bytes"]
    assert in_flight >= tgt.hbm_bandwidth / tgt.num_sms * tgt.hbm_latency_ns * 1e-9
    assert cfg["ring_pages"] >= 2 and cfg["smem_bytes"] <= tgt.smem_per_block
    act = sorted((b.offset, b.offset + b.numel) for b in after.buffers.values() if b.arena == "act")
    assert all(hi <= lo for (_, hi), (lo, _) in zip(act, act[1:], strict=False))  # no overlap


def test_residency_places_ids_and_mla_partials() -> None:
    _, after = until("deepseek-v3.2-tiny", place)
    assert after.buffers["layers.1.moe.expert_ids"].dtype == "int32"
    assert after.buffers["layers.0.dsa.topk"].dtype == "int32"
    assert after.buffers["mla_partials"].numel > 0


def test_a_tile_that_does_not_fit_shared_memory_is_refused() -> None:
    small = dataclasses.replace(get_target("h200"), name="small", smem_per_block=24 * 1024)
    with pytest.raises(ScheduleError) as err:
        schedule(load_spec("llama-3.1-8b"), target=small)
    msg = str(err.value)
    assert msg.startswith("op 'layers.0.ffn.down_proj': one weight row is 28672 B")
    assert "24576 B of shared memory of small" in msg


def test_an_unknown_target_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown target 'h300' \(known: h200, h100, b200\)"):
        schedule(load_spec("llama-tiny"), target="h300")


# -- roles, scheduling, packing, synchronization, cost -----------------------------------------

def test_roles_give_each_cta_a_loader_warp_and_compute_warps() -> None:
    before, after = until("llama-tiny", assign_roles)
    assert "compute_warps" not in before.config
    assert after.config["threads"] == (after.config["compute_warps"] + 1) * 32
    assert after.config["ctas"] == after.target.num_sms
    # the registers a thread may use, as ptxas capped the 16- and 20-warp qwen3-32b FP8 builds
    # that spilled (96 and 80; docs/performance.md, session 31)
    assert [register_cap(65536, (w + 1) * 32) for w in (16, 20)] == [96, 80]
    assert any(f"up to {register_cap(after.target.regs_per_sm, after.config['threads'])} "
               "registers" in d for d in after.decisions)


def test_scheduling_balances_streamed_time_and_keeps_op_order() -> None:
    before, after = until("llama-3.1-8b", schedule_pass)
    assert all(t.sm == -1 for t in before.tasks)
    load = [sum(after.tasks[i].est_ns for i in s) for s in after.streams]
    assert max(load) / (sum(load) / len(load)) - 1 < 0.02
    order = {op.name: i for i, op in enumerate(after.graph.ops())}
    for stream in after.streams:
        ops = [order[after.tasks[i].op] for i in stream]
        assert ops == sorted(ops)


def test_the_dsa_indexer_runs_beside_the_q_absorption() -> None:
    """Both start when q_b is done; the indexer (first in program order) takes its 32 + 1
    SMs, the q absorption the other 99, so neither queues behind the other."""
    before, after = until("deepseek-v3.2", schedule_pass, num_hidden_layers=1,
                          first_k_dense_replace=1)
    absorb, indexer = (after.tasks_of(f"layers.0.{op}") for op in ("q_absorb", "dsa.score"))
    assert len(absorb) == 99 and len(indexer) == 32
    assert before.graph.op("layers.0.q_absorb").attrs["tile"]["tasks"] == 99  # tiling decided
    indexer_sms = {t.sm for t in [*indexer, *after.tasks_of("layers.0.dsa.topk")]}
    # (the top-k may share an SM with a score task, which it waits for anyway)
    assert len({t.sm for t in indexer}) == 32 and not indexer_sms & {t.sm for t in absorb}
    assert sms_beside(before, before.graph.op("layers.0.q_absorb")) == (
        99, ["layers.0.dsa.score", "layers.0.dsa.topk"])


def test_the_latent_append_task_takes_half_a_share_of_the_q_absorption() -> None:
    """The q absorption's first task also appends the latent row (~2.4 us on the H200, the
    op's last task in every profiled step): it takes half the rows of the others."""
    _, after = until("deepseek-v3.2", tile, num_hidden_layers=1, first_k_dense_replace=1)
    rows = [t.rows[1] - t.rows[0] for t in after.tasks_of("layers.0.q_absorb")]
    assert len(rows) == 99 and sum(rows) == 128 * 512
    assert rows[0] == 331 and set(rows[1:]) == {665, 666}
    said = [d for d in after.decisions if "appends the latent row" in d]
    assert len(said) == 1 and "layers.0.q_absorb" in said[0]  # no other op's decision says so
    # an op without the append keeps even shares: v_expand, 16384 rows over 132 SMs
    assert {t.rows[1] - t.rows[0] for t in after.tasks_of("layers.0.v_expand")} == {124, 125}


def test_the_moe_router_and_top_k_run_beside_the_shared_expert() -> None:
    """The router's logits take tasks of ROUTER_ROWS rows (GLM-5: 256 experts on 32 SMs) and
    the shared expert's gate/up, which starts with it, the SMs that the router and its top-k
    leave (99), so that no SM runs both or two shared tasks (one SM with two had its routed
    gate/up start ~7 us late, GLM-5, session 37) and the top-k follows the router at once.
    The `router_tasks` knob overrides the count; a router with no shared expert beside it
    (Qwen3-30B-A3B) takes every SM it can."""
    before, after = until("glm-5", schedule_pass, num_hidden_layers=1, first_k_dense_replace=0)
    shared, router = "layers.0.ffn.shared_experts.gate_up_proj", "layers.0.moe.router"
    assert router_sms(before, before.graph.op(router), 132) == 256 // ROUTER_ROWS == 32
    assert sms_beside(before, before.graph.op(shared)) == (99, [router, "layers.0.moe.topk"])
    tasks = after.tasks_of(shared)
    router_sms_used = {t.sm for t in after.tasks_of(router)}
    assert len(tasks) == 99 and len({t.sm for t in tasks}) == 99
    assert len(router_sms_used) == 32 and not router_sms_used & {t.sm for t in tasks}
    assert after.tasks_of("layers.0.moe.topk")[0].sm not in {t.sm for t in tasks}
    knob = until("glm-5", schedule_pass, num_hidden_layers=1, first_k_dense_replace=0,
                 tuning={"router_tasks": 64})[1]
    assert len(knob.tasks_of(router)) == 64 and len(knob.tasks_of(shared)) == 67
    with pytest.raises(ScheduleError, match="router_tasks=0"):
        until("glm-5", schedule_pass, num_hidden_layers=1, first_k_dense_replace=0,
              tuning={"router_tasks": 0})
    qwen = until("qwen3-30b-a3b", schedule_pass, num_hidden_layers=1)[1]
    assert len(qwen.tasks_of("layers.0.moe.router")) == 128


def test_the_indexer_head_weights_share_the_sms_with_q_b_by_bytes() -> None:
    """The indexer's bf16 head weights (64 rows, 918 KB) start with the FP8 input projection,
    which takes every SM, and only the index scores read them, which wait for q_b_proj too.
    Tiled alone they were 64 one-row tasks, each ahead of a q_b_proj task on its SM; beside
    q_b_proj they take their bytes' share of the SMs (3) and q_b_proj the other 129."""
    before, after = until("deepseek-v3.2", tile, num_hidden_layers=1, first_k_dense_replace=1)
    head_weights, q_b = (after.graph.op(f"layers.0.{op}") for op in ("attn_in_proj.bf16",
                                                                       "q_b_proj"))
    assert "tile" not in before.graph.op(head_weights.name).attrs
    assert beside_partner(before, head_weights) == q_b.name
    assert head_weights.attrs["tile"]["tasks"] == 3 and q_b.attrs["tile"]["tasks"] == 129
    assert head_weights.attrs["tile"]["bytes_per_task"] <= q_b.attrs["tile"]["bytes_per_task"]
    assert sms_beside(after, q_b) == (129, [head_weights.name])
    # nothing else has a partner: q_b_proj's consumers do not all wait for a later op, and the
    # MoE shared expert's partner-to-be (the routed gate/up) waits for the router's top-k
    moe = until("deepseek-v3.2", tile, num_hidden_layers=1, first_k_dense_replace=0)[1]
    assert [op.name for op in moe.graph.ops() if "beside" in op.attrs.get("tile", {})] == [
        head_weights.name]
    scheduled = until("deepseek-v3.2", schedule_pass, num_hidden_layers=1,
                      first_k_dense_replace=1)[1]
    assert not {t.sm for t in scheduled.tasks_of(head_weights.name)} & {
        t.sm for t in scheduled.tasks_of(q_b.name)}
    # the cost model charges it what it takes beyond q_b_proj beside it: here nothing
    times = op_times_ns(scheduled)
    assert times[head_weights.name] == 0.0 and times[q_b.name] > 0.0


def test_packing_lays_each_sm_out_contiguously_and_experts_apart() -> None:
    _, after = until("qwen3-moe-tiny", pack)
    for stream in after.streams:
        offsets = [after.tasks[i].weight_offset for i in stream
                   if static_bytes(after, after.tasks[i])]
        assert offsets == sorted(offsets)
    assert after.config["expert_weight_bytes"] == 2 * 8 * 3 * 32 * 64 * 2
    static = after.config["packed_weight_bytes"] - after.config["expert_weight_bytes"]
    # each routed op a region of 8 experts at a fixed stride after the static weights; a task's
    # offset is where its rows lie in expert 0's part (gate/up rows: 2 x 64 bf16 each)
    region = after.graph.op("layers.0.moe.gate_up").attrs["experts_packed"]
    assert region == {"offset": static, "stride": 32 * 256, "row_bytes": 256, "experts": 8}
    for t in after.tasks_of("layers.0.moe.gate_up"):
        assert t.weight_offset == static + t.rows[0] % 32 * 256 and t.weight_bytes > 0
    down = after.graph.op("layers.0.moe.down_proj").attrs["experts_packed"]
    assert down["offset"] == static + 8 * 32 * 256 and down["stride"] == 64 * 32 * 2


def test_synchronization_prunes_waits_implied_by_other_waits() -> None:
    _, after = until("llama-tiny", synchronize)
    g = after.graph
    o_proj = g.op("layers.0.o_proj")
    producers = {p.name for p in g.producers(o_proj.name)}
    assert producers == {"embed", "layers.0.attention"}  # the residual, and attention
    waits = {after.counters[c].name for c, _, _ in after.tasks_of(o_proj.name)[0].waits}
    assert waits == {"layers.0.attention"}  # embed happens before attention already
    embed = after.tasks_of("embed")[0]
    assert [(after.counters[c].name, lag) for c, _, lag in embed.waits] == [("sample", 1)]


def test_mla_chunks_all_signal_and_v_expand_merges_them() -> None:
    """GQA's last chunk of a group merges it and alone signals (arrival counters); MLA's every
    chunk signals and v_expand merges its heads' chunks as it stages them, so no arrival
    counter exists and v_expand waits for every chunk task."""
    _, gqa = until("llama-tiny", synchronize)
    assert any(c.name.startswith("layers.0.attention.arrivals") for c in gqa.counters)
    _, mla = until("deepseek-v3.2", synchronize, num_hidden_layers=1, first_k_dense_replace=1)
    attn, expand = mla.graph.op("layers.0.attention"), mla.graph.op("layers.0.v_expand")
    assert expand.attrs["merges"] == attn.name and attn.attrs["tile"]["merge"] == expand.name
    assert not any("arrivals" in c.name for c in mla.counters)
    assert all(t.arrive < 0 for t in mla.tasks_of(attn.name))
    counter = next(c for c in mla.counters if c.name == attn.name)
    assert counter.per_step == attn.attrs["tile"]["tasks"] > attn.attrs["tile"]["chunks"]
    assert {mla.counters[c].name for c, _, _ in mla.tasks_of(expand.name)[0].waits} == {attn.name}


def test_cost_charges_routed_fp8_down_rows_their_measured_rate() -> None:
    """DeepSeek-V3.2's routed down rows as FP8 rows (`fp8_mma=0`, a piece per slot on the CUDA
    cores) stream at the rate their page compute kept up with on the H200; as FP8 tiles (the
    default) and Qwen3-30B-A3B's bf16 ones at their bytes."""
    spec = load_spec("deepseek-v3.2", overrides={"num_hidden_layers": 1,
                                                 "first_k_dense_replace": 0})
    rows = schedule(spec, tuning={"fp8_mma": False})
    tiles = schedule(spec)
    bf16 = schedule(load_spec("qwen3-30b-a3b", overrides={"num_hidden_layers": 1}))
    for program, share in ((rows, ROUTED_DOWN_FP8_STREAM_SHARE), (tiles, 1.0), (bf16, 1.0)):
        down = program.tasks_of("layers.0.moe.down_proj")[0]
        assert predicted_task_ns(program, down) == pytest.approx(down.est_ns / share)


def test_cost_charges_mla_its_measured_chain_once_per_layer() -> None:
    """An MLA attention op costs its bytes, a boundary and MLA_CHAIN_NS (the q absorption and
    value expansion around it keep the bandwidth model); other ops no chain."""
    program = schedule(load_spec("deepseek-v3.2", overrides={"num_hidden_layers": 1}),
                       max_seq_len=1024)
    times = op_times_ns(program)
    attn = program.graph.op("layers.0.attention")
    assert attn.opcode == "mla_attention"
    by_sm: dict[int, float] = {}
    for t in program.tasks_of(attn.name):
        by_sm[t.sm] = by_sm.get(t.sm, 0.0) + predicted_task_ns(program, t)
    assert times[attn.name] == pytest.approx(max(by_sm.values()) + BOUNDARY_NS + MLA_CHAIN_NS)
    assert times["layers.0.v_expand"] < MLA_CHAIN_NS


def test_cost_adds_an_all_reduce_under_tensor_parallelism() -> None:
    one, eight = schedule(load_spec("llama-3.1-8b")), schedule(load_spec("llama-3.1-8b"), tp=8)
    t1, t8 = op_times_ns(one), op_times_ns(eight)
    assert t8["layers.0.o_proj"] > eight.target.link_latency_ns
    assert t8["layers.0.qkv_proj"] < t1["layers.0.qkv_proj"]


def test_cost_charges_attention_its_measured_chain_and_kv_rate() -> None:
    spec = load_spec("llama-3.2-1b")
    short, long = schedule(spec, max_seq_len=1024), schedule(spec, max_seq_len=8192)
    a_short, a_long = (op_times_ns(p)["layers.0.attention"] for p in (short, long))
    assert a_short > ATTENTION_CHAIN_NS + BOUNDARY_NS
    # the longest chunk of an SM grows by its extra keys and values at the measured rate
    extra = (max(t.other_bytes for t in long.tasks_of("layers.0.attention"))
             - max(t.other_bytes for t in short.tasks_of("layers.0.attention")))
    assert a_long - a_short == pytest.approx(extra / ATTENTION_KV_BYTES_PER_S_PER_SM * 1e9,
                                             rel=0.05)
    # matrix-vector ops keep the bandwidth model
    assert op_times_ns(short)["layers.0.o_proj"] == op_times_ns(long)["layers.0.o_proj"]


# -- the CUDA backend's refusals -----------------------------------------------------------------

def test_cuda_codegen_refuses_what_it_does_not_run() -> None:
    with pytest.raises(ScheduleError, match=r"op 'layers.0.dsa.score': not yet in the CUDA "
                                            r"backend: index key rows of 18 values"):
        constants(schedule(load_spec("glm-5-tiny", overrides={"index_head_dim": 18})))


def test_sharding_splits_mla_heads_and_keeps_the_latent_path_replicated() -> None:
    _, after = until("deepseek-v3.2", shard, tp=8)
    t = after.graph.tensors
    assert t["layers.0.self_attn.kv_b_proj"].shape == (128 * 256 // 8, 512)
    assert t["layers.0.self_attn.q_b_proj"].shape == (128 * 192 // 8, 1536)
    assert t["layers.0.self_attn.q_a_proj"].shape == (1536, 7168)  # replicated
    assert t["layers.0.self_attn.indexer.wq_b"].shape == (64 * 128, 1536)
    assert after.graph.op("layers.0.attention").attrs["n_heads"] == 16


# -- ready digits ------------------------------------------------------------------------------

def test_ready_digits_pair_each_tiled_projection_with_the_one_that_makes_its_input() -> None:
    """Before / after the pass: with the knob 0 no op reads ready digits; by default every FP8
    tile projection whose input is one tiled projection's whole output (all but the first
    layer's qkv, whose input the embedding makes) reads that producer's digits from a buffer of
    its own, and the kernel is compiled with them."""
    spec = with_weight_dtype(load_spec("llama-3.1-8b"), "fp8")
    off, on = make_program(spec, tuning={"ready_digits": False}), make_program(spec)
    assert not any(op.attrs.get("ready_digits") or "digits_for" in op.attrs
                   for op in off.graph.ops())
    ready = {op.name for op in on.graph.ops() if op.attrs.get("ready_digits")}
    made_by = {op.attrs["digits_for"]: op.name for op in on.graph.ops() if "digits_for" in op.attrs}
    assert made_by.keys() == ready
    assert len(ready) == 3 * spec.num_layers - 1 and "layers.0.qkv_proj" not in ready
    assert made_by["layers.3.ffn.gate_up_proj"] == "layers.3.o_proj"
    assert made_by["layers.3.ffn.down_proj"] == "layers.3.ffn.gate_up_proj"
    assert made_by["layers.4.qkv_proj"] == "layers.3.ffn.down_proj"
    for name in ready:
        assert on.buffers[f"{name}.digits"].numel == digits_floats(on.graph.op(name))
    assert constants(on)["READY_DIGITS"] == 1 and "READY_DIGITS" not in constants(off)


@pytest.mark.parametrize(("weight_dtype", "tp", "tuning"),
                         [("bf16", 1, {}), ("fp8", 2, {}), ("fp8", 1, {"fp8_mma": False})])
def test_ready_digits_without_fp8_tiles_are_refused(weight_dtype: str, tp: int,
                                                    tuning: dict) -> None:
    """Asked for without FP8 tiles: refused; by default: none, silently."""
    spec = with_weight_dtype(load_spec("llama-3.1-8b"), weight_dtype)
    with pytest.raises(ScheduleError, match="ready_digits .* needs FP8 tiles"):
        make_program(spec, tp=tp, tuning={**tuning, "ready_digits": True})
    assert "READY_DIGITS" not in constants(make_program(spec, tp=tp, tuning=tuning))
