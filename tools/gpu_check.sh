#!/usr/bin/env bash
# Everything the GPU should confirm, in one call (for a lent GPU machine with little time):
#
#   bash tools/gpu_check.sh [OUT_DIR]
#
# Installs the checkout (editable, no dependencies: torch and friends are on the machine),
# runs the `gpu` tests, compute-sanitizer memcheck and racecheck on the tiny models
# (tools/sanitize_decode.py), and a short `tilertc bench` of llama-3.2-1b with its profile.
# Logs and bench files go to OUT_DIR (default $OUT, else ./gpu-check); one summary line per
# step goes to stdout. TileLang artifacts compiled elsewhere are used when
# TILERTC_TILELANG_ARTIFACTS names them (docs/backends.md).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${1:-${OUT:-gpu-check}}
mkdir -p "$out"

python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.txt" 2>&1 ||
    { echo "install failed: $out/install.txt"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

timeout 400 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider >"$out/pytest.txt" 2>&1
echo "gpu tests (rc $?): $(tail -1 "$out/pytest.txt")"

sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
# each entry: a model and its sanitize_decode.py arguments (deepseek-v3-tiny with a dense FFN in
# every layer: the MLA kernel; as built in: MLA with DeepSeek's MoE; deepseek-v3.2-tiny and
# glm-5-tiny: with the DSA indexer)
for entry in llama-tiny qwen3-tiny llama-tiny-odd qwen3-moe-tiny \
    "deepseek-v3-tiny config.first_k_dense_replace=3" deepseek-v3-tiny deepseek-v3.2-tiny \
    glm-5-tiny; do
    read -r model args <<<"$entry"
    log=$model${args:+_${args//[ =]/_}}  # one log per entry, not per model
    # shellcheck disable=SC2086  # $args: zero or more words
    timeout 120 "$sanitizer" --tool memcheck --report-api-errors no \
        python3 tools/sanitize_decode.py "$model" $args >"$out/memcheck-$log.txt" 2>&1
    echo "memcheck $entry (rc $?): $(grep -h 'ERROR SUMMARY' "$out/memcheck-$log.txt")"
    # shellcheck disable=SC2086
    timeout 120 "$sanitizer" --tool racecheck \
        python3 tools/sanitize_decode.py "$model" $args >"$out/racecheck-$log.txt" 2>&1
    echo "racecheck $entry (rc $?): $(grep -h 'RACECHECK SUMMARY' "$out/racecheck-$log.txt")"
done

timeout 300 tilertc bench llama-3.2-1b --context 1024 --gen 256 --profile \
    --out "$out/bench-llama-3.2-1b" >"$out/bench.txt" 2>&1
echo "bench (rc $?):"
grep -E '│ (tilertc|hf-|kernel-per-op|measured)' "$out/bench.txt" | tr -s ' '
