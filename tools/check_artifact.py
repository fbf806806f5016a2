"""Check artifact directories without a GPU: `python tools/check_artifact.py DIR [DIR ...]`.

CI runs it on every built-in dense and Qwen3-MoE model after `tilertc compile`: the manifest is
complete and from this compiler, the cubin matches its SHA-256 and holds exactly one kernel
entry, and the source defines exactly one `__global__`. Prints one line per artifact; exits 1
if any fails.
"""

from __future__ import annotations

import sys

from tilertc.artifact import ArtifactError, check_artifact


def main(dirs: list[str]) -> int:
    failed = 0
    for d in dirs:
        try:
            m = check_artifact(d)
        except ArtifactError as e:
            print(f"FAIL {d}: {e}")
            failed += 1
            continue
        k = m["kernel"]
        print(f"ok   {m['model']['name']:<16} {m['target']['arch']:<8} one kernel {k['name']}, "
              f"{k['ptxas'].get('registers', '?')} registers, "
              f"{k['ptxas'].get('spill_stores', 0)} B spilled, hash {m['hash']}")
    return 1 if failed or not dirs else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
