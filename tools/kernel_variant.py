"""Build a variant of a compiled artifact for a kernel experiment, without a GPU:

    python tools/kernel_variant.py ARTIFACT OUT [--define NAME=VALUE ...] [--replace OLD NEW ...]

Copies ARTIFACT to OUT, edits OUT/kernel.cu (each `--define` adds a `#define` before the
first line; each `--replace` swaps every occurrence of the text OLD for NEW, and fails if
there is none), rebuilds the cubin with the same nvcc flags as `tilertc compile` and records
its SHA-256 in the manifest, so that `Engine.load` and `tilertc bench` accept it. The task
table, weight layout and spec hash are unchanged, so `tilertc bench ARTIFACT --artifact OUT`
times the two kernels side by side on the same weights, each behind its own correctness gate.
This is how the kernel variants in docs/performance.md were measured. The cuda backend's
artifacts only (a TileLang build needs its include paths).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

from tilertc.backends.cuda.codegen import compile_cubin


def make_variant(src: Path, dst: Path, defines: list[str], replaces: list[list[str]]) -> dict:
    """OUT as a copy of ARTIFACT with the edits applied and the cubin rebuilt; returns ptxas's
    resource report."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    manifest_path = dst / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    source = (dst / "kernel.cu").read_text()
    for old, new in replaces:
        if old not in source:
            raise SystemExit(f"--replace: {old!r} is not in {src / 'kernel.cu'}")
        source = source.replace(old, new)
    header = "".join(f"#define {d.replace('=', ' ', 1)}\n" for d in defines)
    (dst / "kernel.cu").write_text(header + source)
    report = compile_cubin(dst / "kernel.cu", dst / "kernel.cubin", manifest["target"]["arch"])
    cubin = (dst / "kernel.cubin").read_bytes()
    manifest["kernel"]["cubin_sha256"] = hashlib.sha256(cubin).hexdigest()
    manifest_path.write_text(json.dumps(manifest, indent=1))
    return report


def summary(out: Path, report: dict) -> str:
    """A variant's line: where it is, its registers and spilled bytes."""
    return f"{out}: {report.get('registers')} registers, {report.get('spill_stores', 0)} B spilled"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--define", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--replace", action="append", nargs=2, default=[], metavar=("OLD", "NEW"))
    args = parser.parse_args(argv)
    print(summary(args.out, make_variant(args.artifact, args.out, args.define, args.replace)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
