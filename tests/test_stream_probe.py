"""tools/stream_probe.py: its instrumented variant builds from a freshly compiled kernel (so
the text it edits still exists), and its per-op table from stamps made up with known times."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_fp8_kernel import needs_nvcc

import tilertc
from tilertc.artifact import check_artifact
from tilertc.driver import compile

TOOLS = Path(__file__).parents[1] / "tools"
sys.path.insert(0, str(TOOLS))
from stream_probe import op_streams  # noqa: E402


def test_the_variant_builds_from_a_fresh_kernel(tmp_path: Path) -> None:
    needs_nvcc()
    built = compile(tilertc.load_spec("llama-tiny"), tmp_path / "artifact")
    out = tmp_path / "probe"
    run = subprocess.run([sys.executable, str(TOOLS / "stream_probe.py"), "build", str(built),
                          str(out), "--pages", "64"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "0 B spilled" in run.stdout
    source = (out / "kernel.cu").read_text()
    assert source.startswith("#define PROBE_PAGES 64\n") and source.count("probe[") == 3
    check_artifact(out)


def test_the_table_from_known_stamps() -> None:
    """Two tasks of op `up` on CTAs 0 and 1 and an attention task without pages; page times
    in ns. Task 0: staged 500 ns after its dependencies, two pages seen and released 1 µs
    apart each, 0.1 and 0.5 µs waited, the second issued during the task and seen 1.3 µs
    later; a page seen after the task is not its. Task 1: one page, 2 µs of compute. Their
    first pages were issued 1 and 1.5 µs before their dependencies were met."""
    stamps = np.zeros((2, 3, 3), dtype=np.uint64)
    stamps[1] = [[1500, 1000, 5000], [3000, 2000, 8000], [0, 100, 900]]
    pages = np.zeros((2, 4, 4), dtype=np.uint64)
    pages[0, 0] = [0, 1600, 1700, 2700]
    pages[0, 1] = [2000, 2800, 3300, 4300]
    pages[0, 2] = [4000, 5500, 5600, 6000]  # after task 0 is done
    pages[1, 0] = [500, 3000, 3000, 5000]
    rows = op_streams(stamps, pages, ["up", "up", "attention"], np.array([0, 1, 0]), step=1)
    assert [r.op for r in rows] == ["up"]
    (up,) = rows
    assert up.tasks == 2 and up.pages == 1.5
    assert up.staging_us == pytest.approx((0.5 + 1.0) / 2)
    assert up.page_compute_us == pytest.approx((1.0 + 1.0 + 2.0) / 3)
    assert up.stall_us == pytest.approx((0.6 + 0.0) / 2)
    assert up.flight_us == pytest.approx(1.3)
    assert up.lead_us == pytest.approx((1.0 + 1.5) / 2)  # first pages issued at 0 and 500 ns
