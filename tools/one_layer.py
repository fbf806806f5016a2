"""Build a one-layer model of a layer kind, for kernel experiments without a GPU:

    python tools/one_layer.py MODEL KIND OUT [--weight-dtype fp8|bf16] [--tune KNOB=N ...]
                              [--layers N]

KIND is `dense` or `moe`. The artifact is the model's config with one layer of that kind (or
N: what crosses a layer boundary, e.g. a layer's output as the next one's ready digits), the
vocabulary shrunk, as `tilertc bench --per-layer` times it (`bench_layers.kind_overrides`), and
room for 2048 positions (a 1k context and its tokens). Two such builds (one from a branch, one
from main, or one made by `tools/kernel_variant.py`) compare on a GPU machine in one call:

    tilertc bench OLD --artifact NEW --systems tilertc --context 1024 --gen 64 --rounds 3

and `tools/stream_probe.py build` makes their page-by-page probes. docs/performance.md's
sessions 20-22 one-layer figures were measured this way. The build must come from this script's
checkout: a `tilertc` installed from another one is refused (session 46 timed main against
itself that way); docs/performance.md, "How to benchmark", says how to install an older commit
beside main.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import tilertc
from tilertc.bench import parse_tuning
from tilertc.bench_layers import kind_overrides, layer_kinds
from tilertc.driver import TUNING_KNOBS, CompileOptions, compile

# the installed packages and the checkout folders they are made of (pyproject.toml's package-dir)
PACKAGE_DIRS = {"tilertc": "compiler", "tilertc.ir": "ir", "tilertc.passes": "passes",
                "tilertc.backends.cuda": "backends/cuda"}


def foreign_sources() -> list[str]:
    """The compiler's source files whose installed copy differs from this checkout's."""
    checkout = Path(__file__).resolve().parents[1]
    differ = []
    for package, folder in PACKAGE_DIRS.items():
        installed = Path(importlib.import_module(package).__file__).parent
        for ours in sorted((checkout / folder).glob("*")):
            if ours.suffix in (".py", ".cuh") and (
                    not (installed / ours.name).is_file()
                    or (installed / ours.name).read_bytes() != ours.read_bytes()):
                differ.append(f"{folder}/{ours.name}")
    return differ


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
    args = ap.parse_args()
    differ = foreign_sources()
    if differ:
        sys.exit(f"the tilertc that would build this ({Path(tilertc.__file__).parent}) is not "
                 f"this checkout's: {', '.join(differ[:4])}{' ...' if len(differ) > 4 else ''} "
                 "differ. Install this checkout (pip install -e .), or into a folder of its own "
                 "put on PYTHONPATH (docs/performance.md, 'How to benchmark').")
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
