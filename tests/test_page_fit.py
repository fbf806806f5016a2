"""tools/page_fit.py: its page counts are the ones the page probes measured, and it marks a
task whose last page holds a few rows."""

from __future__ import annotations

import sys
from pathlib import Path

import tilertc
from tilertc.bench_layers import kind_overrides
from tilertc.model_specs.hf import with_weight_dtype
from tilertc.passes.pipeline import make_program

sys.path.insert(0, str(Path(__file__).parents[1] / "tools"))
from page_fit import NEARLY_EMPTY, page_fits  # noqa: E402


def moe_layers(name: str) -> dict:
    """The page fits of two FP8 MoE layers of `name`, by op kind."""
    layers = kind_overrides(tilertc.load_spec(name), "moe", 2)
    spec = with_weight_dtype(tilertc.load_spec(name, overrides=layers), "fp8")
    return {f.kind: f for f in page_fits(make_program(spec, "h200", 1, 2048, {}))}


def test_deepseek_moe_pages_are_the_probes() -> None:
    """docs/performance.md, session 38's page probes of the one-layer DeepSeek-V3.2 MoE: o_proj
    13.6 pages a task, the shared gate/up 5.2, the routed gate/up 28.0, the down 15.6 (means
    over tasks; the largest task's here)."""
    fits = moe_layers("deepseek-v3.2")
    assert {k: fits[k].pages for k in ("o_proj", "ffn.shared_experts.gate_up_proj",
                                       "moe.gate_up", "moe.down_proj")} == {
        "o_proj": 14, "ffn.shared_experts.gate_up_proj": 6, "moe.gate_up": 28, "moe.down_proj": 16}
    assert fits["v_expand"].pages == 1


def test_glm5_q_absorb_spills_a_few_rows_onto_a_second_page() -> None:
    fits = moe_layers("glm-5")
    q = fits["q_absorb"]
    assert q.format == "rows" and q.pages == 2 and q.last_fill <= NEARLY_EMPTY
    others = [f for k, f in fits.items() if k != "q_absorb"]
    assert all(f.pages == 1 or f.last_fill > NEARLY_EMPTY for f in others)
