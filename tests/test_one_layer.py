"""tools/one_layer.py refuses to build with a tilertc installed from another checkout (session
46 timed main against itself that way: the 'old' build had come from the installed main)."""

from __future__ import annotations

import json
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
    kernel = other / "backends" / "cuda" / "decode" / "mla.cuh"
    kernel.write_text(kernel.read_text() + "// an edit the installed tilertc has not seen\n")
    done = subprocess.run([sys.executable, str(other / "tools" / "one_layer.py"), "llama-tiny",
                           "dense", str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 1
    assert "is not this checkout's: backends/cuda/decode/mla.cuh differ" in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("package", sorted(PACKAGE_DIRS))
def test_the_folders_are_pyprojects_package_dirs(package: str) -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert f'"{package}" = "{PACKAGE_DIRS[package]}"' in text


def one_layer(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / "one_layer.py"), *args],
                          capture_output=True, text=True, timeout=600, cwd=cwd)


def cubin_sha(artifact: Path) -> str:
    return json.loads((artifact / "manifest.json").read_text())["kernel"]["cubin_sha256"]


def test_at_builds_with_another_commits_compiler(tmp_path: Path) -> None:
    """--at REV builds in a worktree of REV installed into its own folder: at HEAD, with a
    clean working tree, the cubin this checkout's compiler makes."""
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    home = ROOT / ".out" / f"at-{head[:12]}"
    cached = home.exists()
    try:
        done = one_layer(tmp_path, "llama-tiny", "dense", "at-head", "--at", "HEAD")
        assert done.returncode == 0, done.stderr
        assert (home / "site" / "tilertc").is_dir()
        clean = not subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", "HEAD"]).returncode
        if clean:  # (edits in the working tree are not HEAD's: then only that it built)
            direct = one_layer(tmp_path, "llama-tiny", "dense", "direct")
            assert direct.returncode == 0, direct.stderr
            assert cubin_sha(tmp_path / "at-head") == cubin_sha(tmp_path / "direct")
    finally:
        if not cached:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(home / "tree")], capture_output=True)
            shutil.rmtree(home, ignore_errors=True)


def test_at_refuses_what_is_not_a_commit(tmp_path: Path) -> None:
    done = one_layer(tmp_path, "llama-tiny", "dense", "x", "--at", "no-such-rev")
    assert done.returncode == 1 and "--at no-such-rev: not a commit of" in done.stderr
