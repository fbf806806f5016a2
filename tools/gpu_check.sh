#!/usr/bin/env bash
# Everything the GPU should confirm, in stages that each fit one call of a lent GPU machine
# (10 minutes):
#
#   bash tools/gpu_check.sh [STAGE ...]
#
# STAGE: kernel, tests, full, tp, sanitize, bench, layers, ab, paths, probe, stream, stalls (default:
# kernel, tests, sanitize, bench).
#
# Installs the checkout (editable, no dependencies: torch and friends are on the machine), then
#   kernel    the `gpu` tests of tests/test_cuda_kernel.py but the full-size and tensor-parallel
#             ones (~150 tests, ~7 minutes: together with the others they overran one call);
#   tests     the other `gpu` tests but the full-size and tensor-parallel ones;
#   full      the full-size ones (DeepSeek-V3 / V3.2 / GLM-5 layers; a few minutes each);
#   tp        the tensor-parallel ones (on a machine with two GPUs);
#   sanitize  compute-sanitizer memcheck and racecheck on the tiny models
#             (tools/sanitize_decode.py), all sixteen runs at once: two at a time, eight
#             rounds of 2-3 minutes each did not fit one 10-minute call (the stage last ran
#             whole in session 20; session 54 found a race of session 41's in the task rows);
#   bench     a short `tilertc bench` of llama-3.2-1b with its profile;
#   layers    issue 6's per-layer bench: one FP8 dense and one FP8 MoE layer of DeepSeek-V3.2 and
#             of GLM-5 against their rooflines (`tilertc bench MODEL --weight-dtype fp8
#             --per-layer --layers-timed 2 --context 1024 --gen 128`; ~1 minute a model on
#             an H100, session 67); LAYER_MODELS="glm-5" (say) times only those, for a call with less
#             device time left than both take;
#   ab        two builds of each one-layer model side by side: for every pair of artifacts
#             .out/ab/NAME-old and .out/ab/NAME-new (built on the development machine, e.g.
#             `python tools/one_layer.py glm-5 moe .out/ab/glm-new --weight-dtype fp8` and the
#             same with `--at REV` for -old; carry .out), tools/layer_path.py of each (the
#             op-by-op timeline over 15 steps, with the layer end's standard error: two runs of
#             one kernel differed by ~1.5 us at a layer's end over 3 steps) and
#             one `tilertc bench` of the two (--rounds 3), all into $out/ab.txt; at 1k context,
#             or at N for a NAME with @N (e.g. ds-long@3000: build with --max-seq-len 4096);
#   paths     tools/layer_path.py of every build under .out/ab, whatever its name (e.g. ds-main,
#             ds-vexp, ds-hold: several variants against one baseline), no bench: each table
#             into $out/paths.txt, its MLA chain, MoE ops and the layer's end (± its standard
#             error) to stdout (~20 s a build); a probe stage's build (below) is left out;
#   probe     tools/phase_probe.py run of every build under .out/ab with the probe's marks (made
#             here by `python tools/phase_probe.py build ART .out/ab/NAME --mark ...`), at its
#             context (as ab's), for the ops of a layer (PROBE_OPS): the phases of each op's
#             tasks into $out/probe.txt and to stdout (~10 s a build);
#   stream    tools/stream_probe.py run of every stream probe build under .out/ab (made here by
#             `python tools/stream_probe.py build ART .out/ab/NAME [--pages N]`), at its context:
#             per op, staging, pages a task, a page's compute as compute thread 0 sees it, the
#             waits for pages, into $out/stream.txt and to stdout;
#   stalls    tools/stall_profile.py run of every build under .out/ab that paths times: Nsight
#             Compute's warp samples per SASS instruction, by stall reason, into
#             $out/stalls-NAME.csv (~10 MB, ~1 minute a build); fold them on the development
#             machine with `python tools/stall_profile.py report .out/ab/NAME stalls-NAME.csv`.
# Logs and bench files go to $OUT (a lent machine's output folder), else ./gpu-check; one
# summary line per step goes to stdout. With NEEDS_GPU set (e.g. NEEDS_GPU=H200) nothing runs
# unless the GPU's name contains it: a call that asks for an H200 without needs_h200 may get an
# H100, and a verdict run (`NEEDS_GPU=H200 bash tools/gpu_check.sh layers`) then costs the
# machine's start instead of ~5 minutes of device time for timings that do not count.
# OTHERWISE names the stages to run instead on such a machine, so that the start buys H100
# timings rather than nothing (sessions 57-68 asked for an H200 and mostly got an H100 or no
# machine at all): `NEEDS_GPU=H200 OTHERWISE="paths stream" bash tools/gpu_check.sh layers`.
# TileLang artifacts compiled elsewhere are used when TILERTC_TILELANG_ARTIFACTS names them
# (docs/backends.md).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-gpu-check}
mkdir -p "$out"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(kernel tests sanitize bench)
read -r -a otherwise <<<"${OTHERWISE:-}"
for stage in "${stages[@]}" "${otherwise[@]}"; do
    case $stage in
        kernel | tests | full | tp | sanitize | bench | layers | ab | paths | probe | stream | stalls) ;;
        *) echo "unknown stage '$stage' (kernel, tests, full, tp, sanitize, bench, layers, ab, paths, probe, stream, stalls)"; exit 2 ;;
    esac
done

gpus=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)
gpu=${gpus%%,*}  # the first GPU's name
if [ -n "${NEEDS_GPU:-}" ] && [[ "$gpu" != *"$NEEDS_GPU"* ]]; then
    if [ ${#otherwise[@]} -eq 0 ]; then
        echo "NEEDS_GPU=$NEEDS_GPU, but this machine has ${gpu:-no GPU}: nothing run"
        exit 3
    fi
    echo "NEEDS_GPU=$NEEDS_GPU, but this machine has ${gpu:-no GPU}: running ${otherwise[*]} instead"
    stages=("${otherwise[@]}")
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.txt" 2>&1 ||
    { echo "install failed: $out/install.txt"; exit 1; }
echo "${gpus:-nvidia-smi found no GPU}"

# The `gpu` tests selected by a pytest -k expression (and pytest arguments after it), logged to
# $out/pytest-NAME.txt.
gpu_tests() {
    local name=$1 select=$2
    shift 2
    timeout 540 python3 -m pytest -m gpu -q -rfE -p no:cacheprovider -k "$select" "$@" \
        >"$out/pytest-$name.txt" 2>&1
    echo "gpu tests, $name (rc $?): $(tail -1 "$out/pytest-$name.txt")"
}

kernel() { gpu_tests kernel "not full_size and not tp_" tests/test_cuda_kernel.py; }
tests() { gpu_tests tests "not full_size and not tp_" --ignore=tests/test_cuda_kernel.py; }
full() { gpu_tests full "full_size"; }
tp() { gpu_tests tp "tp_"; }

# One tool on one entry: a model and its sanitize_decode.py arguments.
sanitize_one() {
    local tool=$1 entry=$2 model args log extra=()
    read -r model args <<<"$entry"
    log=$tool-$model${args:+_${args//[ =]/_}}  # one log per entry, not per model
    [ "$tool" = memcheck ] && extra=(--report-api-errors no)
    # shellcheck disable=SC2086  # $args: zero or more words
    timeout 500 "$sanitizer" --tool "$tool" "${extra[@]}" \
        python3 tools/sanitize_decode.py "$model" $args >"$out/$log.txt" 2>&1
    echo "$tool $entry (rc $?): $(grep -h 'SUMMARY' "$out/$log.txt" | tr -s ' ')"
}

sanitize() {
    sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    # deepseek-v3-tiny with a dense FFN in every layer: the MLA kernel; as built in: MLA with
    # DeepSeek's MoE; deepseek-v3.2-tiny and glm-5-tiny: with the DSA indexer
    local entry
    for entry in llama-tiny qwen3-tiny llama-tiny-odd qwen3-moe-tiny \
        "deepseek-v3-tiny config.first_k_dense_replace=3" deepseek-v3-tiny deepseek-v3.2-tiny \
        glm-5-tiny; do
        sanitize_one memcheck "$entry" &
        sanitize_one racecheck "$entry" &
    done
    wait
}

bench() {
    timeout 300 tilertc bench llama-3.2-1b --context 1024 --gen 256 --profile \
        --out "$out/bench-llama-3.2-1b" >"$out/bench.txt" 2>&1
    echo "bench (rc $?):"
    grep -E '│ (tilertc|hf-|kernel-per-op|measured)' "$out/bench.txt" | tr -s ' '
}

layers() {
    local model
    for model in ${LAYER_MODELS:-deepseek-v3.2 glm-5}; do
        timeout 240 tilertc bench "$model" --weight-dtype fp8 --per-layer --layers-timed 2 \
            --context 1024 --gen 128 --out "$out/per-layer-$model" >"$out/per-layer-$model.txt" 2>&1
        echo "layers $model (rc $?):"
        grep -E '│ (dense|moe) ' "$out/per-layer-$model.txt" | head -2 | tr -s ' '
    done
}

# The context a build under .out/ab is timed at: 1k, or N for a name with @N (ds-long@3000-old).
context_of() {
    local n=${1##*@}
    if [[ $1 == *@* ]]; then echo "${n%%[!0-9]*}"; else echo 1024; fi
}

# The number of report $1's next line (1 if it does not exist yet): where a section starts.
next_line() {
    echo $(($([ -f "$1" ] && wc -l <"$1" || echo 0) + 1))
}

# tools/layer_path.py of build $1 over 15 steps at its context, appended to report $2.
timeline() {
    timeout 90 python3 tools/layer_path.py "$1" --context "$(context_of "$1")" --steps 16 \
        --later-steps >>"$2" 2>&1
}

ab() {
    local old name context from report=$out/ab.txt pairs=0
    for old in .out/ab/*-old; do
        [ -d "$old" ] && [ -d "${old%-old}-new" ] || continue
        name=$(basename "${old%-old}")
        context=$(context_of "$name")
        pairs=$((pairs + 1))
        from=$(next_line "$report")  # this pair's lines
        for build in old new; do
            echo "== $name-$build: layer_path" >>"$report"
            timeline ".out/ab/$name-$build" "$report"
        done
        echo "== $name: bench old (baseline) against new" >>"$report"
        timeout 240 tilertc bench "$old" --artifact ".out/ab/$name-new" --systems tilertc \
            --context "$context" --gen 64 --rounds 3 --out "$out/bench-ab-$name" >>"$report" 2>&1
        echo "ab $name (rc $?): $(grep -E '│ tilertc' "$report" | tail -2 | tr -s ' ' | tr '\n' ' ')"
        echo "  layer ends, old then new: $(tail -n "+$from" "$report" | grep "the layer's end" |
            sed 's/.*end: //; s/ (.*//' | tr '\n' ';')"
    done
    [ $pairs -gt 0 ] || echo "ab: no pair of .out/ab/NAME-old and .out/ab/NAME-new"
}

# The builds under .out/ab that are not a probe stage's (below), one a line.
plain_builds() {
    local build
    for build in .out/ab/*/; do
        build=${build%/}
        has_marks "$build" || is_stream_build "$build" || echo "$build"
    done
}

paths() {
    local build from report=$out/paths.txt
    [ -d .out/ab ] || { echo "paths: no .out/ab"; return; }
    for build in $(plain_builds); do
        from=$(next_line "$report")  # this build's lines
        echo "== $build" | tee -a "$report"
        timeline "$build" "$report" || echo "  layer_path failed (rc $?): $report"
        tail -n "+$from" "$report" | grep -E "^  (op |q_absorb|attention |v_expand|o_proj|moe\.|the layer)"
    done
}

# the ops of a MoE layer with MLA (layers folded); an op a build lacks prints no tasks
PROBE_OPS=(attn_in_proj q_b_proj q_absorb dsa.score attention v_expand o_proj moe.router
    ffn.shared_experts.gate_up_proj moe.gate_up moe.down_proj ffn.gate_up_proj ffn.down_proj)

# A phase probe's build (tools/phase_probe.py build) and a stream probe's (tools/stream_probe.py
# build: its kernel defines PROBE_PAGES) are the probe stages', which paths leaves out.
has_marks() { [ -f "$1/phase_marks.json" ]; }
is_stream_build() { grep -q '^#define PROBE_PAGES ' "$1/kernel.cu" 2>/dev/null; }

# tools/$1.py run of every build under .out/ab that test $2 accepts, at its context (with the
# arguments after $3), into $out/$3.txt and to stdout.
probe_builds() {
    local tool=$1 accepts=$2 name=$3 report=$out/$3.txt build from builds=0
    shift 3
    for build in .out/ab/*/; do
        build=${build%/}
        "$accepts" "$build" || continue
        builds=$((builds + 1))
        from=$(next_line "$report")
        timeout 120 python3 "tools/$tool.py" run "$build" --context "$(context_of "$build")" "$@" \
            >>"$report" 2>&1 || echo "  $tool failed (rc $?): $report"
        tail -n "+$from" "$report"
    done
    [ $builds -gt 0 ] || echo "$name: no $tool build under .out/ab"
}

probe() { probe_builds phase_probe has_marks probe "${PROBE_OPS[@]/#/--op=}"; }
stream() { probe_builds stream_probe is_stream_build stream; }

stalls() {
    local build name
    [ -d .out/ab ] || { echo "stalls: no .out/ab"; return; }
    for build in $(plain_builds); do
        name=$(basename "$build")
        timeout 240 python3 tools/stall_profile.py run "$build" "$out/stalls-$name.csv" \
            --context "$(context_of "$build")" >"$out/stalls-$name.txt" 2>&1
        echo "stalls $build (rc $?): $out/stalls-$name.csv ($(cat "$out/stalls-$name.csv" 2>/dev/null | wc -l) lines)"
    done
}

for stage in "${stages[@]}"; do
    "$stage"
done
