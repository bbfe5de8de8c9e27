#!/bin/sh
# The speed table of the CUDA issue, on the GPU of the machine it runs on:
# runs an already built bench_gpu (builds nothing) once per model shape,
# each run bounded in time, keeps every table, log and JSON under $OUT, and
# prints the tables last.
#   OUT=/tmp/out ./scripts/gpu-bench.sh                 # build-gpubench, cuda:0
#   LLM_BENCH_BIN=build/bench/bench_gpu LLM_BENCH_DEVICE=cuda:1 ./scripts/gpu-bench.sh
#   LLM_BENCH_DEVICE=cpu LLM_BENCH_PLAN="tiny:60" ./scripts/gpu-bench.sh   # a check without a GPU
# LLM_BENCH_KV=f16,q8_0 measures every model with both KV cache types.
# Budget: about 6 minutes in all (TinyLlama shape 100 s, 7B shape 250 s);
# the synthetic models are written to the first folder with room for the
# largest (7B F16, 13.5 GB) and deleted after each model.
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu-bench}
mkdir -p "$out"
bin=${LLM_BENCH_BIN:-build-gpubench/bench/bench_gpu}
device=${LLM_BENCH_DEVICE:-cuda:0}
if [ ! -x "$bin" ]; then
    echo "gpu-bench: $bin is missing: build it first (cmake --build build-gpubench --target bench_gpu)" >&2
    exit 2
fi

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.max.sm,clocks.max.mem --format=csv 2>&1 || true
    ldd "$bin" | grep -E "not found|cuda|cublas" || true
    df -h /tmp . 2>&1 || true
} >"$out/machine.txt" 2>&1

# A folder with at least 20 GB free for the models, in order of preference.
tmp=""
for d in "${TMPDIR:-/tmp}" /tmp /dev/shm "$PWD"; do
    [ -d "$d" ] && [ -w "$d" ] || continue
    free_kb=$(df -Pk "$d" | awk 'NR == 2 { print $4 }')
    if [ "${free_kb:-0}" -ge 20000000 ]; then
        tmp=$d
        break
    fi
done
if [ -z "$tmp" ]; then
    echo "gpu-bench: no folder with 20 GB free for the synthetic models (tried \$TMPDIR, /tmp, /dev/shm, .)" >&2
    cat "$out/machine.txt" >&2
    exit 1
fi
echo "gpu-bench: models under $tmp; results under $out" >&2

status=0
# shape, seconds allowed; types in order of importance, so that a run cut
# short by its bound still has the quantized rows.
run() {
    shape=$1
    limit=$2
    types=$3
    echo "gpu-bench: $shape ($types), at most $limit s" >&2
    timeout --signal=TERM --kill-after=10 "$limit" "$bin" --device "$device" --shapes "$shape" --types "$types" \
        --batches 1,8,32,64 --ctx 512 --prompt 512 --steps 10 --warmup 2 --prefill-reps 3 --tmpdir "$tmp" \
        --kv-type "${LLM_BENCH_KV:-f16}" \
        --json "$out/bench-$shape.json" >"$out/bench-$shape.txt" 2>"$out/bench-$shape.log"
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "gpu-bench: $shape: exit status $rc$( [ $rc -eq 124 ] && echo ' (time limit)'); log tail:" >&2
        tail -n 15 "$out/bench-$shape.log" >&2
        status=1
    fi
}
plan=${LLM_BENCH_PLAN:-tinyllama-1.1b:100 llama2-7b:250}
for item in $plan; do
    run "${item%%:*}" "${item##*:}" q4_k_m,q8_0,f16
done
# Whatever a run killed past its grace period left behind.
rm -rf "$tmp"/bench_gpu_*

for item in $plan; do
    cat "$out/bench-${item%%:*}.txt" 2>/dev/null
done
exit $status
