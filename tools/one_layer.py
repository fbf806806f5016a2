"""Build a one-layer model of a layer kind, for kernel experiments without a GPU:

    python tools/one_layer.py MODEL KIND OUT [--weight-dtype fp8|bf16] [--tune KNOB=N ...]
                              [--layers N] [--at REV]

KIND is `dense` or `moe`. The artifact is the model's config with one layer of that kind (or
N: what crosses a layer boundary, e.g. a layer's output as the next one's ready digits), the
vocabulary shrunk, as `tilertc bench --per-layer` times it (`bench_layers.kind_overrides`), and
room for 2048 positions (a 1k context and its tokens). Two such builds (one from a branch, one
from main, or one made by `tools/kernel_variant.py`) compare on a GPU machine in one call:

    tilertc bench OLD --artifact NEW --systems tilertc --context 1024 --gen 64 --rounds 3

and `tools/stream_probe.py build` makes their page-by-page probes. docs/performance.md's
sessions 20-22 one-layer figures were measured this way. The build must come from this script's
checkout: a `tilertc` installed from another one is refused (session 46 timed main against
itself that way). `--at REV` builds with the compiler of another commit instead: a worktree of
this checkout at REV, installed into a folder of its own (both under `.out/at-SHA`, kept for the
next build), runs its own copy of this tool.
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
from pathlib import Path

import tilertc
from tilertc.bench import parse_tuning
from tilertc.bench_layers import kind_overrides, layer_kinds
from tilertc.driver import TUNING_KNOBS, CompileOptions, compile

# the installed packages and the checkout folders they are made of (pyproject.toml's package-dir)
PACKAGE_DIRS = {"tilertc": "compiler", "tilertc.ir": "ir", "tilertc.passes": "passes",
                "tilertc.backends.cuda": "backends/cuda", "tilertc.model_specs": "model_specs"}


def foreign_sources() -> list[str]:
    """The compiler's source files whose installed copy differs from this checkout's."""
    checkout = Path(__file__).resolve().parents[1]
    differ = []
    for package, folder in PACKAGE_DIRS.items():
        installed = Path(importlib.import_module(package).__file__).parent
        for ours in sorted((checkout / folder).rglob("*")):
            name = ours.relative_to(checkout / folder)
            if ours.suffix in (".py", ".cuh") and (
                    not (installed / name).is_file()
                    or (installed / name).read_bytes() != ours.read_bytes()):
                differ.append(f"{folder}/{name}")
    return differ


def build_at(rev: str, args: argparse.Namespace) -> int:
    """Runs this build with the compiler of commit `rev` (see the module docstring); its exit
    status."""
    checkout = Path(__file__).resolve().parents[1]
    found = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--verify", "--quiet",
                            f"{rev}^{{commit}}"], capture_output=True, text=True)
    if found.returncode:
        sys.exit(f"--at {rev}: not a commit of {checkout}")
    sha = found.stdout.strip()
    home = checkout / ".out" / f"at-{sha[:12]}"
    tree, site = home / "tree", home / "site"
    if not tree.is_dir():
        # (-f: a worktree whose folder went with .out is still registered)
        subprocess.run(["git", "-C", str(checkout), "worktree", "add", "-f", "--detach", str(tree),
                        sha], check=True, capture_output=True)
    if not (site / "tilertc").is_dir():
        print(f"installing {sha[:12]}'s tilertc into {site}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                        "--no-build-isolation", "--target", str(site), str(tree)], check=True)
    model = Path(args.model)
    argv = [str(model.resolve()) if model.exists() else args.model, args.kind,
            str(Path(args.out).resolve())]
    argv += ["--weight-dtype", args.weight_dtype] if args.weight_dtype else []
    argv += [f"--tune={t}" for t in args.tune]
    argv += ["--max-seq-len", str(args.max_seq_len)] if args.max_seq_len != 2048 else []
    argv += ["--layers", str(args.layers)] if args.layers != 1 else []
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run([sys.executable, str(tree / "tools" / "one_layer.py"), *argv],
                          env=env, cwd=home).returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a built-in name or a config.json")
    ap.add_argument("kind", choices=("dense", "moe"))
    ap.add_argument("out", help="the artifact directory to write")
    ap.add_argument("--weight-dtype", choices=("fp8", "bf16"), default=None,
                    help="the weights' format [default: the config's own]")
    ap.add_argument("--tune", action="append", default=[], metavar="KNOB=N",
                    help=f"a schedule knob ({', '.join(TUNING_KNOBS)}), as `tilertc compile`")
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=1, help="layers of the kind [default: 1]")
    ap.add_argument("--at", metavar="REV", help="build with the compiler of this commit")
    args = ap.parse_args()
    if args.at:
        sys.exit(build_at(args.at, args))
    differ = foreign_sources()
    if differ:
        sys.exit(f"the tilertc that would build this ({Path(tilertc.__file__).parent}) is not "
                 f"this checkout's: {', '.join(differ[:4])}{' ...' if len(differ) > 4 else ''} "
                 "differ. Install this checkout (pip install -e .), or build with another "
                 "commit's compiler by --at REV.")
    spec = tilertc.load_spec(args.model)
    if args.kind not in layer_kinds(spec):
        ap.error(f"{spec.name} has no {args.kind} layers (it has: {', '.join(layer_kinds(spec))})")
    try:
        tuning = dict(parse_tuning(tuple(args.tune)))
    except ValueError as e:
        ap.error(f"--tune: {e}")
    if args.layers < 1:
        ap.error("--layers: at least 1")
    variant = tilertc.load_spec(args.model, overrides=kind_overrides(spec, args.kind, args.layers))
    compile(variant, args.out, CompileOptions(max_seq_len=args.max_seq_len,
                                              weight_dtype=args.weight_dtype, **tuning))
    print(f"{args.out}: {spec.name}, {args.layers} {args.kind} layer" + "s" * (args.layers > 1))


if __name__ == "__main__":
    main()
