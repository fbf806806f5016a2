"""How a page's rows are dealt to a group's warps (decode.cuh: warps_per_row and matvec_pages'
row loop): with fewer rows in a page than warps, GROUP_WARPS / rows warps (rounded down, not to
a power of two) share each row, each a segment of it, their sums meeting in s.acc; with more,
a warp takes whole rows (two at a time for FP8). A whole decode step of the kernel's own code on
the host, with 6 compute warps and 2 KB pages so that rows split 3 and 2 ways, against the
interpreter; and a rule that deals a row's segments twice must fail it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import test_mla_kernel
from test_mla_kernel import assert_step_matches, random_host_step

import tilertc
from tilertc.backends.cuda import codegen, encode
from tilertc.model_specs.hf import with_weight_dtype
from tilertc.passes.program import Program

WARPS = 6
TUNING = {"compute_warps": WARPS, "page_kb": 2}
# rows of 512 to 1088 bytes: pages of 1 to 7 rows
WIDE = {"hidden_size": 256, "intermediate_size": 384, "head_dim": 64}
PARTS = ("attn_out", "x.attn", "x.ffn")


def warps_per_row(program: Program) -> set[int]:
    """decode.cuh's warps_per_row of every matrix-vector task of the program."""
    col = {n: i for i, n in enumerate(encode.fields(program))}
    page = codegen.constants(program)["PAGE_BYTES"]
    out = set()
    for row in encode.encode(program)[0]:
        rb, rows = int(row[col["row_bytes"]]), int(row[col["row1"]]) - int(row[col["row0"]])
        if rb > 0:
            out.add(max(1, WARPS // min(page // rb, rows)))
    return out


def spec(weight_dtype: str) -> tilertc.ModelSpec:
    return with_weight_dtype(tilertc.load_spec("llama-tiny", overrides=WIDE), weight_dtype)


@pytest.mark.parametrize("weight_dtype", ["bf16", "fp8"])
def test_rows_split_over_three_warps_on_the_host_are_the_interpreters(tmp_path: Path,
                                                                      weight_dtype: str) -> None:
    model = spec(weight_dtype)
    program, token, bufs, env, _ = random_host_step(tmp_path, model, "h200", 20, TUNING)
    assert 3 in warps_per_row(program)  # not a power of two: the rule the step runs under
    assert_step_matches(bufs, env, token, model.num_layers, PARTS)


def test_dealing_a_segment_twice_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control: one warp more per row (at most the group's warps) than the group
    has for a page's rows, which sums a row's first segments twice, gives wrong row sums."""
    source = test_mla_kernel.step_source
    good = "return max(1, GROUP_WARPS / rows_in_page); }"
    bad = "return min(GROUP_WARPS, GROUP_WARPS / rows_in_page + 1); }"
    assert good in source()
    monkeypatch.setattr(test_mla_kernel, "step_source", lambda: source().replace(good, bad))
    model = spec("bf16")
    program, token, bufs, env, _ = random_host_step(tmp_path, model, "h200", 20, TUNING)
    with pytest.raises(AssertionError, match="max difference"):
        assert_step_matches(bufs, env, token, model.num_layers, PARTS)
