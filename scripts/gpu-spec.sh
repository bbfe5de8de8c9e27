#!/bin/bash
# Speculative decoding's speed on one lent GPU host without build tools
# (issue 31; docs/router.md, "Speculation"; docs/performance.md): unpacks an
# sm_90 pack (scripts/gpu-pack.sh) and runs, each step bounded and the whole
# held under a deadline:
#   verify   bench_gpu --verify 4, llama2-7b Q4_K_M synthetic, batch 1,
#            context 512: a step of 5 tokens against a one-token step
#            (the issue's <= 1.3x)
#   ceiling  scripts/bench-spec.sh on the 7B Q4_K_M synthetic, 1x1, batch 1,
#            k = 4 and 8: off, ngram and prediction-fixed (the perfect-draft
#            ceiling: a greedy output given back as the prediction, until a
#            run accepts all of it), tokens/s end to end and decode only
#            (the issue's >= 2.5x)
#   pycode   scripts/bench-spec.sh on the pycode pair (target F16 + draft):
#            off, ngram, draft and prediction-fixed, with acceptance; then off,
#            ngram and draft again under llm-router --spec-adapt
#   load     bench_cluster, 7B Q4_K_M synthetic, 1x1, c=64, prompt 128, 128
#            generated: the router's --spec off, --spec auto, then off again
#            (the issue's <= 3% cost; the second off bounds the drift)
# Logs under $OUT (one per step, the tables in them) and a summary printed
# last; the exit status is 1 when any step failed or was skipped.  On the CPU
# a step whose outputs differ between modes fails (bench-spec.sh compares
# ids); on a GPU the difference is reported (EXACT=0, below).
#   OUT=/tmp/out LLM_GPU_PACK=gpu-pack/sm90.tar.xz ./scripts/gpu-spec.sh
#   LLM_SPEC_STEPS="verify ceiling" ./scripts/gpu-spec.sh          # some steps only
# A check on the CPU (no pack: a build folder; small shapes):
#   LLM_SPEC_BUILD=$PWD/build LLM_SPEC_DEVICE=cpu LLM_SPEC_SHAPE=tiny ./scripts/gpu-spec.sh
# Env: LLM_SPEC_S (530: the deadline, seconds), LLM_SPEC_SHAPE (llama2-7b),
# LLM_SPEC_PYCODE (the pycode target's file in the models' pycode/:
# pycode-target-f16.gguf; pycode-target-q4_k_m.gguf fits a pack with the
# draft), LLM_SPEC_FILES (prompt files; default three of /usr/lib/python3.*, else
# the repository's own Python scripts), LLM_SPEC_LINES (40: lines of each
# file a prompt holds), LLM_SPEC_MAX_TOKENS (128),
# LLM_MODELS_DIR (default the pack's models).  Needs bash, awk, tar, xz,
# timeout and redis-server (.deps/env.sh is sourced when present).
set -u
cd "$(dirname "$0")/.." || exit 2
t_start=$(date +%s)
deadline=$((t_start + ${LLM_SPEC_S:-530}))
out=${OUT:-/tmp/gpu-spec}
mkdir -p "$out" || exit 2
export NCCL_NVLS_ENABLE=0
[ -f .deps/env.sh ] && . .deps/env.sh
steps=${LLM_SPEC_STEPS:-verify ceiling pycode load}
device=${LLM_SPEC_DEVICE:-auto}
shape=${LLM_SPEC_SHAPE:-llama2-7b}
maxt=${LLM_SPEC_MAX_TOKENS:-128}
lines=${LLM_SPEC_LINES:-40}
summary="$out/summary.txt"
: >"$summary"
status=0
note() { echo "$*" | tee -a "$summary" >&2; }
fail() {
    note "FAIL $*"
    status=1
}

unpack() {
    local pack=$1 build
    [ -f "$pack" ] || { echo ""; return; }
    build=$(tar -xJf "$pack" -O build.path) || { echo ""; return; }
    [ -d "$build" ] || tar -xJf "$pack" -C / --exclude=build.path || { echo ""; return; }
    echo "$build"
}
if [ -n "${LLM_SPEC_BUILD:-}" ]; then
    b=$(cd "$LLM_SPEC_BUILD" && pwd) || exit 2
else
    b=$(unpack "${LLM_GPU_PACK:-gpu-pack/sm90.tar.xz}")
    if [ -z "$b" ]; then
        note "FAIL gpu-spec: no pack at ${LLM_GPU_PACK:-gpu-pack/sm90.tar.xz} (scripts/gpu-pack.sh), nor LLM_SPEC_BUILD"
        cat "$summary"
        exit 1
    fi
fi
models=${LLM_MODELS_DIR:-}
[ -z "$models" ] && [ -d "$b/models" ] && models=$b/models
[ -z "$models" ] && [ -d ../shared/models ] && models=$(cd ../shared/models && pwd)
export LLM_MODELS_DIR=$models
[ -d "$b/rt" ] && export LD_LIBRARY_PATH="$b/rt${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
bench_dev=cuda:0
[ "$device" = cpu ] && bench_dev=cpu
# The CUDA kernels' greedy output depends on a step's row count (a
# verification step of k + 1 rows may round differently from a step of
# one), so on a GPU a speculating mode's difference from off is reported,
# with the token it starts at, rather than failed; the CPU's kernels are
# batch-invariant and stay exact.
exact=1
[ "$device" = cpu ] || exact=0
{
    date -u
    nvidia-smi --query-gpu=index,name,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1
    echo "cores: $(nproc)"
    echo "build: $b; models: ${models:-none}; device: $device"
    git log --oneline -1 2>/dev/null
} >"$out/machine.txt"
note "gpu-spec: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1) build $b, unpacked in $(( $(date +%s) - t_start )) s"

# The pack must be of this code: flags the steps use.
missing=""
for bin in bench/bench_gpu bench/bench_cluster router/llm-cluster router/llm-router worker/llm-worker worker/llm-synth \
    clients/c/llm; do
    [ -x "$b/$bin" ] || missing="$missing $bin"
done
[ -n "$missing" ] && { note "FAIL gpu-spec: not in $b:$missing"; cat "$summary"; exit 1; }
"$b/bench/bench_gpu" --help 2>&1 | grep -q -- "--verify" || { note "FAIL gpu-spec: $b/bench/bench_gpu has no --verify: an older pack"; status=1; }
"$b/clients/c/llm" generate --help 2>&1 | grep -q -- "--prediction" || { note "FAIL gpu-spec: $b/clients/c/llm has no generate --prediction: an older pack"; status=1; }
command -v redis-server >/dev/null || note "gpu-spec: no redis-server on PATH (.deps/env.sh): the cluster steps will fail"

# A folder with room for a 7B model and bench_gpu's own copy.
tmp=""
for d in "${TMPDIR:-/tmp}" /tmp /dev/shm "$PWD"; do
    [ -d "$d" ] && [ -w "$d" ] || continue
    if [ "$(df -Pk "$d" | awk 'NR == 2 { print $4 }')" -ge 10000000 ]; then
        tmp=$d
        break
    fi
done
[ -n "$tmp" ] || { note "FAIL gpu-spec: no folder with 10 GB free"; cat "$summary"; exit 1; }

# Prompts: the CPU figures' files where the host has them.
files=()
if [ -n "${LLM_SPEC_FILES:-}" ]; then
    read -r -a files <<<"$LLM_SPEC_FILES"
else
    py=$(ls -d /usr/lib/python3.* 2>/dev/null | head -1)
    if [ -n "$py" ] && [ -r "$py/textwrap.py" ] && [ -r "$py/shlex.py" ] && [ -r "$py/json/encoder.py" ]; then
        files=("$py/textwrap.py" "$py/shlex.py" "$py/json/encoder.py")
    else
        files=(scripts/check_tok_pretok.py scripts/gen_unicode_tables.py tests/gateway/node/structured.mjs)
    fi
fi
note "     prompts: ${files[*]}"

# step NAME BOUND_S COMMAND...: under the smaller of its bound and the time
# left, output in $OUT/NAME.log, one summary line and the log's tables.
step() {
    local name=$1 bound=$2 left rc t0
    shift 2
    left=$((deadline - $(date +%s) - 5))
    if [ "$left" -lt 20 ]; then
        fail "$name: skipped, out of time (deadline ${LLM_SPEC_S:-530} s)"
        return
    fi
    [ "$bound" -gt "$left" ] && bound=$left
    t0=$(date +%s)
    timeout --signal=TERM --kill-after=15 "$bound" "$@" >"$out/$name.log" 2>&1
    rc=$?
    local took=$(( $(date +%s) - t0 ))
    if [ $rc -eq 0 ]; then
        note "ok   $name (${took} s)"
    else
        fail "$name: exit status $rc$([ $rc -eq 124 ] && echo " (bound of $bound s)") after ${took} s"
        grep -E "DIFFER|FAIL|error|failed|not " "$out/$name.log" | head -n 6 | sed 's/^/     /' | tee -a "$summary" >&2
    fi
}

model=""
# The 7B Q4_K_M synthetic the ceiling and load steps share, written once.
synth_model() {
    [ -n "$model" ] && return 0
    model=$tmp/gpu-spec-$shape-q4_k_m.gguf
    local t0
    t0=$(date +%s)
    if ! timeout 150 "$b/worker/llm-synth" --out "$model" --shape "$shape" --type q4_k_m >"$out/synth.log" 2>&1; then
        fail "llm-synth $shape q4_k_m: see synth.log"
        rm -f "$model"
        model=""
        return 1
    fi
    note "     $shape q4_k_m written in $(( $(date +%s) - t0 )) s"
}

for what in $steps; do
    case $what in
    verify)
        step verify 170 "$b/bench/bench_gpu" --device "$bench_dev" --shapes "$shape" --types q4_k_m --batches 1 \
            --ctx 512 --prompt 512 --verify 4 --steps 20 --warmup 3 --prefill-reps 1 --capacity-budget 0 \
            --tmpdir "$tmp" --json "$out/verify.json"
        rm -rf "$tmp"/bench_gpu_*
        ;;
    ceiling)
        synth_model || continue
        for k in 4 8; do
            MODES="off ngram prediction-fixed" DEVICE=$device MAX_TOKENS=$maxt LINES_PER_PROMPT=$lines SPEC_TOKENS=$k \
                EXACT=$exact RESULTS="$out/ceiling_k$k.results" \
                step "ceiling_k$k" 150 scripts/bench-spec.sh "$b" "$model" "${files[@]}"
        done
        ;;
    pycode)
        pt=$models/pycode/${LLM_SPEC_PYCODE:-pycode-target-f16.gguf}
        [ -r "$pt" ] || { fail "pycode: no $pt"; continue; }
        MODES="off ngram draft prediction-fixed" DEVICE=$device MAX_TOKENS=$maxt LINES_PER_PROMPT=$lines SPEC_TOKENS=4 \
            EXACT=$exact RESULTS="$out/pycode.results" step pycode 120 scripts/bench-spec.sh "$b" "$pt" "${files[@]}"
        MODES="off ngram draft" ROUTER_ARGS="--spec-adapt" DEVICE=$device MAX_TOKENS=$maxt LINES_PER_PROMPT=$lines \
            SPEC_TOKENS=4 EXACT=$exact RESULTS="$out/pycode_adapt.results" step pycode_adapt 90 scripts/bench-spec.sh "$b" \
            "$pt" "${files[@]}"
        ;;
    load)
        synth_model || continue
        for run in off auto off2; do
            mkdir -p "$out/load_$run-runs"
            step "load_$run" 80 "$b/bench/bench_cluster" --model "$model" --device "$device" --layouts 1x1 \
                --concurrency 64 --prompt-tokens 128 --max-tokens 128 --warmup 2 --router-args "--spec ${run%2}" \
                --up-timeout-s 120 --up-tries 1 --tmpdir "$tmp" --run-root "$out/load_$run-runs" \
                --json "$out/load_$run.json"
            for d in "$out/load_$run-runs"/*/; do
                [ -d "$d" ] && "$b/router/llm-cluster" down --run-dir "$d" >/dev/null 2>&1
            done
            tar -czf "$out/load_$run-runs.tar.gz" -C "$out" "load_$run-runs" 2>/dev/null && rm -rf "${out:?}/load_$run-runs"
        done
        ;;
    *) fail "unknown step \"$what\" (verify, ceiling, pycode, load)" ;;
    esac
done
[ -n "$model" ] && rm -f "$model"

{
    echo
    echo "== gpu-spec summary ($(( $(date +%s) - t_start )) s)"
    cat "$summary"
    if [ -f "$out/verify.log" ]; then
        echo "== verify: bench_gpu --verify 4"
        grep -A4 "^verification (--verify)" "$out/verify.log"
        grep -E "decode +f16 +1 " "$out/verify.log"
    fi
    for s in ceiling_k4 ceiling_k8 pycode pycode_adapt; do
        [ -f "$out/$s.log" ] || continue
        echo "== $s: scripts/bench-spec.sh"
        grep -E "^bench-spec: .* on |DIFFER|differ|equals its prediction|NOT FIXED" "$out/$s.log"
        sed -n '/^mode /,$p' "$out/$s.log"
    done
    if [ -f "$out/load_off.log" ]; then
        echo "== load: bench_cluster 1x1 c=64, prompt 128, 128 generated: router --spec off, auto, off again"
        for run in off auto off2; do
            [ -f "$out/load_$run.log" ] && grep -h "c=64:" "$out/load_$run.log" | sed "s/^/--spec ${run%2}: /"
        done
    fi
} | tee "$out/report.txt"
exit $status
