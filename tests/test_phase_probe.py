"""tools/phase_probe.py: its marked variant builds from a freshly compiled kernel (so the lines
it marks still exist), refuses a mark that is not in the kernel once, and its per-task phases
come out of stamps made up with known times."""

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
from phase_probe import BEFORE, RESET, build, marked_source, phases  # noqa: E402

ATTENTION_MARKS = ["  const KvChunk ch = kv_chunk(t, pos);",
                   "  if (!last_to_arrive(p, s, t, g, step, chunks, ct)) return false;"]


def test_the_variant_builds_from_a_fresh_kernel(tmp_path: Path) -> None:
    needs_nvcc()
    built = compile(tilertc.load_spec("llama-tiny"), tmp_path / "artifact")
    out = tmp_path / "phases"
    marks = sum((["--mark", m] for m in ATTENTION_MARKS), [])
    run = subprocess.run([sys.executable, str(TOOLS / "phase_probe.py"), "build", str(built),
                          str(out), *marks], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    source = (out / "kernel.cu").read_text()
    assert source.count("phase_mark(p, 0);\n" + ATTENTION_MARKS[0]) == 1
    assert source.count("phase_mark(p, 1);\n" + ATTENTION_MARKS[1]) == 1
    check_artifact(out)


def test_the_marking_warp_is_the_one_asked_for(tmp_path: Path) -> None:
    """--warp 3: lane 0 of compute warp 3 (thread 96) stamps; a warp the kernel lacks is
    refused before anything is built."""
    source = marked_source("x();\n" + BEFORE + RESET, ["x();"], warp=3)
    assert "threadIdx.x != 96) return;" in source and "threadIdx.x != 0)" not in source
    assert RESET + "  if (threadIdx.x == 96) phase_count() = 0;\n" in source
    art = tmp_path / "art"
    art.mkdir()
    (art / "kernel.cu").write_text("x();\n" + BEFORE + RESET)
    (art / "manifest.json").write_text('{"kernel": {"constants": {"COMPUTE_WARPS": 4}}}')
    with pytest.raises(SystemExit, match="--warp 4: the kernel has compute warps 0-3"):
        build(art, tmp_path / "out", ["x();"], warp=4)
    assert not (tmp_path / "out").exists()


def test_a_mark_not_once_in_the_kernel_is_refused() -> None:
    with pytest.raises(SystemExit, match="in the kernel 2 times"):
        marked_source("a();\nb();\na();\n" + RESET, ["a();"])
    with pytest.raises(SystemExit, match="in the kernel 0 times"):
        marked_source("a();\n" + RESET, ["c();"])


def test_the_count_of_marks_is_zeroed_once_or_refused() -> None:
    """The marks' count lives in the kernel's shared flags, zeroed by the marking thread where
    run_compute starts: a kernel without that line (or with two) is refused."""
    with pytest.raises(SystemExit, match="nowhere to zero the marks' count"):
        marked_source("a();\n" + BEFORE, ["a();"])
    with pytest.raises(SystemExit, match="2 lines"):
        marked_source("a();\n" + BEFORE + RESET + RESET, ["a();"])


def test_the_phases_from_known_stamps() -> None:
    """Two `attention` tasks on CTAs 0 and 1 and a `qkv` task; times in ns. Task 0: marks a
    (at +200), b twice (+500, +900, a loop), done at +1000; task 1: mark a (+400), done at
    +1000; a mark of CTA 0 after task 0 is not its."""
    stamps = np.array([[0, 1000, 2000], [0, 3000, 4000], [0, 0, 500]], dtype=np.uint64)
    log = np.zeros((2, 8, 2), dtype=np.uint64)
    log[0, :4] = [[0, 1200], [1, 1500], [1, 1900], [0, 2500]]
    log[1, 0] = [0, 3400]
    tasks, us, times = phases(stamps, log, ["attention", "attention", "qkv"], np.array([0, 1, 0]),
                              "attention", ["a", "b"])
    assert tasks == 2
    assert us == pytest.approx({"deps met -> a": 0.3, "a -> b": 0.15, "b -> b": 0.2,
                                "b -> done": 0.05, "a -> done": 0.3})
    assert times == pytest.approx({"deps met -> a": 1, "a -> b": 0.5, "b -> b": 0.5,
                                   "b -> done": 0.5, "a -> done": 0.5})
