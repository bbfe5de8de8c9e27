#!/bin/bash
# The cluster issue's table on the machine it runs on: runs already built
# bench_cluster, llm-cluster, llm-router and llm-worker (builds nothing)
# once per model shape, each run bounded in time, keeps the tables, logs and
# the clusters' run dirs under $OUT, and prints the tables last.
#   OUT=/tmp/out ./scripts/cluster-bench.sh          # build-clbench, --device auto
#   LLM_BENCH_DEVICE=cpu LLM_BENCH_THREADS=1 LLM_CLUSTER_BENCH_PLAN="tiny:60" ./scripts/cluster-bench.sh
# With --device auto each worker takes one GPU: on a 2-GPU machine 1x1 is one
# GPU, 1x2 two GPUs linked by NCCL (two stages), 1x2s the same with NCCL held
# to sockets (as between T4 hosts), 2x1 two GPUs as replicas.  Settings:
# LLM_BENCH_LAYOUTS, LLM_BENCH_CONC (concurrency levels), LLM_BENCH_TYPE
# (synthetic weight types), LLM_BENCH_WORKER_ARGS (llm-worker flags; empty:
# the workers size themselves), LLM_BENCH_ARGS (more bench_cluster flags).
# Run-time libraries and redis-server come from .deps/env.sh (see
# shared/scripts/bundle-runtime-deps.sh) and $build/rt (libcjson) when there.
# Budget: about 3 minutes (100m shape 70 s, TinyLlama shape 90 s).
# Under $OUT: bench-SHAPE.txt (the table), .json, .log (stderr), machine.txt
# and cluster-logs.tar.gz (every cluster's run dir).
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/cluster-bench}
mkdir -p "$out"
build=${LLM_BENCH_BUILD:-build-clbench}
device=${LLM_BENCH_DEVICE:-auto}
threads=${LLM_BENCH_THREADS:-0}
layouts=${LLM_BENCH_LAYOUTS:-1x1,1x2,1x2s,2x1}
conc=${LLM_BENCH_CONC:-1,4,16,64}
wtype=${LLM_BENCH_TYPE:-f16}
worker_args=${LLM_BENCH_WORKER_ARGS:-}
case $build in /*) ;; *) build=$PWD/$build ;; esac
# NVLink multicast stays off: it can take a shared host's GPUs out of service.
export NCCL_NVLS_ENABLE=0
[ -f .deps/env.sh ] && . .deps/env.sh
[ -d "$build/rt" ] && export LD_LIBRARY_PATH="$build/rt${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

bins="$build/bench/bench_cluster $build/router/llm-cluster $build/router/llm-router $build/worker/llm-worker"
{
    date -u
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv 2>&1
    else
        echo "nvidia-smi: none (no NVIDIA driver)"
    fi
    nproc
    command -v redis-server || echo "redis-server: not in PATH"
    for b in $bins; do
        echo "== ldd $b"
        ldd "$b" 2>&1 | grep -E "=> not found|zmq|hiredis|cjson|protobuf|cuda|cublas|nccl" || true
    done
} >"$out/machine.txt" 2>&1
for b in $bins; do
    if [ ! -x "$b" ]; then
        echo "cluster-bench: $b is missing: build it first (cmake --build $build --target bench_cluster" \
            "llm-cluster llm-router llm-worker)" >&2
        exit 2
    fi
done
if grep -q "=> not found" "$out/machine.txt"; then
    echo "cluster-bench: libraries are missing (see machine.txt):" >&2
    grep -E "^==|=> not found" "$out/machine.txt" >&2
    exit 2
fi
if ! command -v redis-server >/dev/null; then
    echo "cluster-bench: redis-server is not in PATH (carry .deps from shared/scripts/bundle-runtime-deps.sh)" >&2
    exit 2
fi

tmp=${TMPDIR:-/tmp}
runs="$tmp/cluster-bench-runs"
rm -rf "$runs"
mkdir -p "$runs"
status=0
# shape, seconds allowed.  A run cut short by its bound still prints the
# rows it measured (bench_cluster stops its clusters on SIGTERM).
run() {
    shape=$1
    limit=$2
    echo "cluster-bench: $shape on $device ($layouts), at most $limit s" >&2
    mkdir -p "$runs/$shape"
    # shellcheck disable=SC2086
    timeout --signal=TERM --kill-after=20 "$limit" "$build/bench/bench_cluster" --shape "$shape" --type "$wtype" \
        --device "$device" --threads "$threads" --layouts "$layouts" --concurrency "$conc" \
        --prompt-tokens 128 --max-tokens 64 --worker-args "$worker_args" --up-timeout-s 120 \
        --tmpdir "$tmp" --run-root "$runs/$shape" --json "$out/bench-$shape.json" ${LLM_BENCH_ARGS:-} \
        >"$out/bench-$shape.txt" 2>"$out/bench-$shape.log"
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "cluster-bench: $shape: exit status $rc$( [ $rc -eq 124 ] && echo ' (time limit)'); log tail:" >&2
        tail -n 15 "$out/bench-$shape.log" >&2
        status=1
    fi
    # Whatever a run killed past its grace period left running.
    for d in "$runs/$shape"/*/; do
        [ -d "$d" ] && "$build/router/llm-cluster" down --run-dir "$d" >/dev/null 2>&1
    done
}
plan=${LLM_CLUSTER_BENCH_PLAN:-100m:70 tinyllama-1.1b:90}
for item in $plan; do
    run "${item%%:*}" "${item##*:}"
done
# Leftover synthetic models of killed runs.
rm -rf "$tmp"/bench_cluster_*
tar -czf "$out/cluster-logs.tar.gz" -C "$runs" . 2>/dev/null
rm -rf "$runs"

for item in $plan; do
    cat "$out/bench-${item%%:*}.txt" 2>/dev/null
done
exit $status
