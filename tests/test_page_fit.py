"""tools/page_fit.py: its page counts are the ones the page probes measured, and it marks a
task whose last page holds a few rows."""

from __future__ import annotations

import sys
from pathlib import Path

import tilertc
from tilertc.bench_layers import kind_overrides
from tilertc.model_specs.hf import with_weight_dtype
from tilertc.passes.pipeline import make_program
from tilertc.passes.program import Program

sys.path.insert(0, str(Path(__file__).parents[1] / "tools"))
from page_fit import NEARLY_EMPTY, page_fits  # noqa: E402


def moe_program(name: str, **tuning: int) -> Program:
    """The schedule of two FP8 MoE layers of `name`."""
    layers = kind_overrides(tilertc.load_spec(name), "moe", 2)
    spec = with_weight_dtype(tilertc.load_spec(name, overrides=layers), "fp8")
    return make_program(spec, "h200", 1, 2048, tuning)


def by_kind(program: Program) -> dict:
    """The page fits of `program`, by op kind."""
    return {f.kind: f for f in page_fits(program)}


def moe_layers(name: str, **tuning: int) -> dict:
    """The page fits of two FP8 MoE layers of `name`, by op kind."""
    return by_kind(moe_program(name, **tuning))


def test_deepseek_moe_pages_are_the_probes() -> None:
    """docs/performance.md, session 38's page probes of the one-layer DeepSeek-V3.2 MoE: o_proj
    13.6 pages a task, the shared gate/up 5.2, the routed gate/up 28.0, the down 15.6 (means
    over tasks; the largest task's here)."""
    fits = moe_layers("deepseek-v3.2")
    assert {k: fits[k].pages for k in ("o_proj", "ffn.shared_experts.gate_up_proj",
                                       "moe.gate_up", "moe.down_proj")} == {
        "o_proj": 14, "ffn.shared_experts.gate_up_proj": 6, "moe.gate_up": 28, "moe.down_proj": 16}
    assert fits["v_expand"].pages == 1


def test_a_page_grows_to_hold_a_row_task_that_spills_a_few_rows() -> None:
    """GLM-5's q absorption (331-333 rows of 208 B, 320 a 64 KB page) and qwen3-30b-a3b FP8's
    o_proj (16 rows of 4224 B, 15 a 64 KB page) spill past 64 KB pages, as tools/page_fit.py
    marks; by default the page grows to take their tasks whole (passes/residency.py)."""
    for name, kind in (("glm-5", "q_absorb"), ("qwen3-30b-a3b", "o_proj")):
        asked = moe_layers(name, page_kb=64)[kind]
        assert asked.format == "rows" and asked.pages == 2 and asked.last_fill <= NEARLY_EMPTY
        program = moe_program(name)
        fits = by_kind(program)
        assert fits[kind].pages == 1
        assert all(f.pages == 1 or f.last_fill > NEARLY_EMPTY for f in fits.values())
        grown = [d for d in program.decisions if d.startswith("[residency] ring page")]
        assert len(grown) == 1 and kind in grown[0].split(" of ")[1], grown


def test_a_page_does_not_grow_where_the_ring_would_lose_a_page() -> None:
    """qwen3-1.7b FP8's qkv tasks (31-32 rows of 2112 B) spill 2 KB past a 64 KB page, but the
    ring holds 3 pages of 64 KB and only 2 of 66 KB: the page stays, and the spill with it."""
    spec = with_weight_dtype(tilertc.load_spec("qwen3-1.7b"), "fp8")
    program = make_program(spec, "h200", 1, 2048, {})
    assert (program.config["ring_pages"], program.config["page_bytes"]) == (3, 65536)
    qkv = by_kind(program)["qkv_proj"]
    assert qkv.pages == 2 and qkv.last_fill <= NEARLY_EMPTY
