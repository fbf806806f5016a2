"""`tilertc explain`: per fused op its tile, tasks, SMs, pipeline depth, residency, roles and
predicted time; the predicted latency; every decision. Text, JSON, folding, --tp, errors."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner, Result

from tilertc import load_spec, schedule
from tilertc.cli import main
from tilertc.explain import explain, explain_program


def cli(*args: str) -> Result:
    return CliRunner().invoke(main, ["explain", *args])


def test_text_has_the_table_the_prediction_and_the_decisions() -> None:
    result = cli("llama-tiny")
    assert result.exit_code == 0, result.output
    out = result.output
    for needle in ("layers.0-1.qkv_proj", "norm_matvec", "pages/task", "residency",
                   "HBM, packed in stream order", "L2-resident fp32", "tokens/s/user",
                   "of the bandwidth roofline", "decisions:", "[fusion] 36 ops -> 13 fused ops"):
        assert needle in out, needle


def test_json_agrees_with_the_program_and_the_cost_model() -> None:
    result = cli("llama-tiny", "--json", "--max-seq-len", "256")
    assert result.exit_code == 0, result.output
    d = json.loads(result.output)
    program = schedule(load_spec("llama-tiny"), max_seq_len=256)
    assert d["decisions"] == program.decisions
    t = d["totals"]
    assert t["tokens_per_s"] == pytest.approx(1e9 / t["step_ns"])
    assert t["roofline_fraction"] == pytest.approx(t["roofline_ns"] / t["step_ns"])
    assert t["tasks"] == len(program.tasks)
    qkv = next(op for op in d["ops"] if op["name"] == "layers.0-1.qkv_proj")
    assert (qkv["count"], qkv["opcode"], qkv["tasks"]) == (2, "norm_matvec", 128)
    assert qkv["residency"]["layers.0-1.qkv"].startswith("L2-resident fp32")
    assert sum(op["predicted_ns"] * op["count"] for op in d["ops"]) == pytest.approx(t["step_ns"])


def test_folding_is_only_a_view() -> None:
    program = schedule(load_spec("llama-tiny"))
    folded, flat = explain_program(program), explain_program(program, fold=False)
    assert len(flat.rows) == 13 and len(folded.rows) == 8
    assert sum(r.count for r in folded.rows) == len(flat.rows)
    assert folded.totals == flat.totals


def test_the_tile_says_which_ops_run_on_the_tensor_cores() -> None:
    """FP8 projections whose K tiles (and DeepSeek's routed experts) say "FP8 tiles"; MLA's
    head rows, the bf16 router and a bf16 model's ops do not."""
    tiles = {r.name: r.tile for r in explain(load_spec("deepseek-v3.2"), max_seq_len=1024).rows}
    for name in ("layers.3-60.o_proj", "layers.3-60.moe.gate_up", "layers.3-60.moe.down_proj",
                 "layers.0-2.ffn.down_proj"):
        assert tiles[name].endswith(", FP8 tiles"), (name, tiles[name])
    for name in ("layers.3-60.q_absorb", "layers.3-60.v_expand", "layers.3-60.moe.router"):
        assert "FP8 tiles" not in tiles[name], (name, tiles[name])
    bf16 = explain_program(schedule(load_spec("llama-tiny"))).rows
    assert not any("FP8 tiles" in r.tile for r in bf16)


def test_tensor_parallel_roles_and_all_reduces() -> None:
    # FP8 weights are scheduled at --tp 1 only: explain the bf16 variant.
    ex = explain(load_spec("deepseek-v3.2", {"quantization_config": None}), tp=8, max_seq_len=1024)
    roles = {r.name: r.roles for r in ex.rows}
    assert roles["layers.3-60.o_proj"].endswith("row-parallel + all-reduce")
    assert roles["layers.3-60.moe.gate_up"].endswith("expert-parallel")
    assert roles["layers.3-60.moe.down_proj"].endswith("expert-parallel + all-reduce")
    assert roles["layers.3-60.attn_in_proj"].endswith("replicated")
    assert ex.totals["allreduces"] == 122 and 0 < ex.totals["roofline_fraction"] < 1


def test_a_moe_block_without_a_shared_expert_all_reduces_once() -> None:
    """Qwen3-MoE's gate/up and down projection are both fused from the experts op whose output
    is the partial sum; only the down projection, which adds the residual, all-reduces."""
    ex = explain(load_spec("qwen3-moe-tiny"), tp=2, max_seq_len=64)
    roles = {r.name: r.roles for r in ex.rows}
    assert roles["layers.0-1.moe.gate_up"].endswith("expert-parallel")
    assert roles["layers.0-1.moe.down_proj"].endswith("expert-parallel + all-reduce")
    assert ex.totals["allreduces"] == 2 * 2  # o_proj and the MoE output, per layer


@pytest.mark.parametrize(("args", "code", "message"), [
    (["llama-tiny", "--target", "h300"], 2, "'h300' is not one of"),
    (["llama-3.1-8b", "--tp", "3"], 1, "number of attention heads 32 is not divisible by 3"),
    (["llama-tinyy"], 1, "did you mean llama-tiny"),
])
def test_errors(args: list[str], code: int, message: str) -> None:
    result = cli(*args)
    assert result.exit_code == code and message in result.output
