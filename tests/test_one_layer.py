"""tools/one_layer.py refuses to build with a tilertc installed from another checkout (session
46 timed main against itself that way: the 'old' build had come from the installed main)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from one_layer import PACKAGE_DIRS, foreign_sources  # noqa: E402


def test_this_checkout_builds_its_own_sources() -> None:
    assert foreign_sources() == []


def test_another_checkouts_sources_are_named(tmp_path: Path) -> None:
    """A copy of the script in a checkout whose kernel source differs by one line names that
    file, and the script exits with that error before compiling anything."""
    other = tmp_path / "other"
    (other / "tools").mkdir(parents=True)
    shutil.copy(ROOT / "tools" / "one_layer.py", other / "tools")
    for folder in PACKAGE_DIRS.values():
        shutil.copytree(ROOT / folder, other / folder, ignore=shutil.ignore_patterns("__pycache__"))
    kernel = other / "backends" / "cuda" / "decode.cuh"
    kernel.write_text(kernel.read_text() + "// an edit the installed tilertc has not seen\n")
    done = subprocess.run([sys.executable, str(other / "tools" / "one_layer.py"), "llama-tiny",
                           "dense", str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 1
    assert "is not this checkout's: backends/cuda/decode.cuh differ" in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("package", sorted(PACKAGE_DIRS))
def test_the_folders_are_pyprojects_package_dirs(package: str) -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert f'"{package}" = "{PACKAGE_DIRS[package]}"' in text
