#!/bin/bash
# One GPU session for the capacity and KV issues, on a lent GPU host without
# build tools: unpacks an sm_90 pack and a 75-virtual pack (scripts/gpu-pack.sh),
# then runs, each step bounded and the whole held under a deadline:
#   tests    the CUDA op tests (8-bit KV included), sampling, the forward pass
#            against the goldens and the NCCL link, from the sm_90 pack
#   t4       the same op, sampling and forward tests routed as sm_75
#            (LLM_CUDA_SM=75) from the 75-virtual pack: the T4's own code
#   kv       bench_gpu, 7B Q4_K_M, decode at batch 1 and 64 with context 2048,
#            F16 against Q8_0 KV, and the capacity line (16 GiB, context 2048)
#   link     test_link (its two-GPU cases need two GPUs) and test_node_stages
#            (two workers chained over NCCL against the goldens: two GPUs)
#   cluster  bench_cluster, 7B Q4_K_M, layouts 1x1,1x2,1x2s,2x1 at
#            concurrency 64 and 128 (prompt 128, LLM_SESSION_GEN or 64
#            generated), workers at their own sizing
#   c1       bench_cluster, 7B Q4_K_M, concurrency 1, 32 requests, prompt
#            128, 128 generated: 1x1, 1x2, 1x1, 1x2 (two GPUs; the cost of
#            a second stage to one stream)
#   c1spin   c1's 1x1 and 1x2 with each --spin-us of LLM_SESSION_C1_SPINS
#            ("-1 0": auto, then blocking) on the router and workers, in turn, for
#            LLM_SESSION_C1_ROUNDS (2) rounds (two GPUs)
#   timeline 1x1 and 1x2 at concurrency 1 with the router and workers at
#            debug level: scripts/step-timeline.py's segments of a decode
#            step (plan to each stage, each stage's phases, result back) in
#            timeline.txt (1x1 alone on one GPU), once for each entry (--spin-us)
#            of LLM_SESSION_TIMELINE_SPINS (default "0")
#   prefix   bench_cluster, 7B Q4_K_M, 1x1: 1,024-token shared prefix + 64
#            distinct 32-token questions, 64 generated, concurrency 16, the
#            router's prefix cache on and off
#   wait     the prefix step's load with llm-router --batch-wait-us
#            (LLM_SESSION_WAIT_US, 1000) on both sides, then c=1 (prompt
#            128, 64 generated) without and with it: what the wait costs
#            a request that finds the pipeline idle
#   itl      bench_cluster, 7B Q4_K_M, 1x1 (LLM_SESSION_ITL_LAYOUT), c=64, prompt 128, 128 generated,
#            256 requests: the router's defaults, workers' steps of 1,024
#            tokens (--max-batch-tokens 1024), then hand-tuned (--max-seqs
#            64, --itl-target-ms 0): ITL p50/p90 and throughput
#   gateway  scripts/gateway-bench.sh: llm-gateway + serve-bench against
#            bench_cluster through libllmclient, 7B Q4_K_M, 1x1, c=1 and 64
#            (needs node on PATH and the pack's llm-gateway and llm)
# Logs, tables and JSON go under $OUT; a summary is printed last.
#   OUT=/tmp/out LLM_GPU_PACK=gpu-pack/sm90.tar.xz LLM_GPU_PACK_T4=gpu-pack/sm75.tar.xz ./scripts/gpu-session.sh
#   LLM_SESSION_STEPS="tests kv" ./scripts/gpu-session.sh        # some steps only
#   LLM_SESSION_STEPS="cluster prefix" LLM_SESSION_SHAPE=tiny LLM_SESSION_PREFIX=256 \
#       ./scripts/gpu-session.sh                                    # a check on the CPU
# Planned for 2 x H100 (expected / bound, seconds): unpack 15/60, tests
# 80/230, t4 100/200, kv 100/170, cluster 150/210, prefix 60/110; the
# deadline (LLM_SESSION_S, 540) cuts each bound to the time left and skips
# what no longer fits.  With one GPU the layouts of two stages or two
# pipelines are left out (NCCL needs a GPU per stage).
set -u
cd "$(dirname "$0")/.." || exit 2
t_start=$(date +%s)
deadline=$((t_start + ${LLM_SESSION_S:-540}))
out=${OUT:-/tmp/gpu-session}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
[ -f .deps/env.sh ] && . .deps/env.sh
steps=${LLM_SESSION_STEPS:-tests t4 kv cluster prefix}
summary="$out/summary.txt"
: >"$summary"
note() { echo "$*" | tee -a "$summary" >&2; }

# The build folder of a pack, unpacked at its absolute path when not there yet.
unpack() {
    local pack=$1 build
    [ -f "$pack" ] || { echo ""; return; }
    build=$(tar -xJf "$pack" -O build.path) || { echo ""; return; }
    [ -d "$build" ] || tar -xJf "$pack" -C / --exclude=build.path
    echo "$build"
}
b90=$(unpack "${LLM_GPU_PACK:-gpu-pack/pack.tar.xz}")
b75=$(unpack "${LLM_GPU_PACK_T4:-gpu-pack/sm75.tar.xz}")
[ -n "$b90" ] || note "gpu-session: no sm_90 pack at ${LLM_GPU_PACK:-gpu-pack/pack.tar.xz}: tests, kv, cluster and prefix skipped"
[ -n "$b75" ] || note "gpu-session: no 75-virtual pack at ${LLM_GPU_PACK_T4:-gpu-pack/sm75.tar.xz}: t4 skipped"
models=${LLM_MODELS_DIR:-}
for b in "$b90" "$b75"; do
    [ -z "$models" ] && [ -n "$b" ] && [ -d "$b/models" ] && models=$b/models
done
export LLM_MODELS_DIR=$models
[ -n "$b90" ] && [ -d "$b90/rt" ] && export LD_LIBRARY_PATH="$b90/rt${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
{
    date -u
    nvidia-smi --query-gpu=index,name,memory.total,memory.used,clocks.max.sm,clocks.max.mem --format=csv 2>&1
    nproc
    df -h /tmp /dev/shm . 2>&1
    echo "sm_90 pack: ${b90:-none}; 75-virtual pack: ${b75:-none}; models: ${models:-none}"
} >"$out/machine.txt"
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
note "gpu-session: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1) x $gpus; unpacked in $(( $(date +%s) - t_start )) s"

status=0
# step NAME BOUND_S COMMAND...: runs it under the smaller of its bound and
# the time left, its output in $OUT/NAME.log; one summary line.
step() {
    local name=$1 bound=$2 left rc t0
    shift 2
    left=$((deadline - $(date +%s) - 5))
    if [ "$left" -lt 20 ]; then
        note "SKIP $name: out of session time"
        status=1
        return
    fi
    [ "$bound" -gt "$left" ] && bound=$left
    t0=$(date +%s)
    timeout --signal=TERM --kill-after=15 "$bound" "$@" >"$out/$name.log" 2>&1
    rc=$?
    local took=$(( $(date +%s) - t0 )) counts
    counts=$(grep -E "tests: |passed|failed" "$out/$name.log" | tail -n 1)
    if [ $rc -eq 0 ]; then
        note "ok   $name (${took} s) $counts"
    else
        note "FAIL $name: exit status $rc$([ $rc -eq 124 ] && echo " (bound of $bound s)") after ${took} s $counts"
        grep -E "^\[ FAIL \]|did not run|first problem|error:" "$out/$name.log" | head -n 5 | sed 's/^/     /' | tee -a "$summary" >&2
        status=1
    fi
}

# A folder with room for a 7B Q4_K_M model (4 GB) and its copies.
tmp=""
for d in "${TMPDIR:-/tmp}" /tmp /dev/shm "$PWD"; do
    [ -d "$d" ] && [ -w "$d" ] || continue
    if [ "$(df -Pk "$d" | awk 'NR == 2 { print $4 }')" -ge 12000000 ]; then
        tmp=$d
        break
    fi
done
model=""
shape=${LLM_SESSION_SHAPE:-llama2-7b}
# The 7B Q4_K_M model the cluster steps share, written once (and kept for
# the next call on the same machine with LLM_SESSION_KEEP_MODEL=1).
cluster_model() {
    [ -n "$model" ] && return 0
    [ -n "$tmp" ] || { note "gpu-session: no folder with 12 GB free for the 7B model"; return 1; }
    model=$tmp/gpu-session-$shape-q4_k_m.gguf
    if [ -n "${LLM_SESSION_KEEP_MODEL:-}" ] && [ -s "$model" ]; then
        note "     $shape q4_k_m kept from an earlier call"
        return 0
    fi
    local t0
    t0=$(date +%s)
    if ! timeout 120 "$b90/worker/llm-synth" --out "$model" --shape "$shape" --type q4_k_m >"$out/synth.log" 2>&1; then
        note "FAIL llm-synth: see synth.log"
        rm -f "$model"
        model=""
        status=1
        return 1
    fi
    note "     $shape q4_k_m written in $(( $(date +%s) - t0 )) s"
}
cluster() {
    local name=$1 bound=$2 layouts=$3
    shift 3
    mkdir -p "$out/$name-runs"
    step "$name" "$bound" "$b90/bench/bench_cluster" --model "$model" --device auto --layouts "$layouts" \
        --up-timeout-s 120 --up-tries 1 --tmpdir "$tmp" --run-root "$out/$name-runs" --json "$out/$name.json" "$@"
    # What a run cut at its bound left running.
    for d in "$out/$name-runs"/*/; do
        [ -d "$d" ] && "$b90/router/llm-cluster" down --run-dir "$d" >/dev/null 2>&1
    done
    tar -czf "$out/$name-runs.tar.gz" -C "$out" "$name-runs" 2>/dev/null && rm -rf "${out:?}/$name-runs"
}

for what in $steps; do
    case $what in
    tests)
        [ -n "$b90" ] || continue
        step cuda_ops 60 "$b90/tests/test_cuda_ops"
        step cuda_attention 60 "$b90/tests/test_cuda_attention"
        step cuda_sample 40 "$b90/tests/test_cuda_sample"
        LLM_TEST_DEVICE=cuda:0 step forward_gpu 40 "$b90/tests/test_forward"
        step link 60 "$b90/tests/test_link"
        LLM_TEST_DEVICE=cuda:0 step kv_q8_gpu 60 "$b90/tests/test_kv_q8"
        ;;
    t4)
        [ -n "$b75" ] || continue
        LLM_CUDA_SM=75 step cuda_ops_sm75 90 "$b75/tests/test_cuda_ops"
        LLM_CUDA_SM=75 step cuda_attention_sm75 90 "$b75/tests/test_cuda_attention"
        LLM_CUDA_SM=75 step cuda_sample_sm75 40 "$b75/tests/test_cuda_sample"
        LLM_CUDA_SM=75 LLM_TEST_DEVICE=cuda:0 step forward_gpu_sm75 40 "$b75/tests/test_forward"
        [ -x "$b75/tests/test_kv_q8" ] && LLM_CUDA_SM=75 LLM_TEST_DEVICE=cuda:0 step kv_q8_gpu_sm75 60 "$b75/tests/test_kv_q8"
        ;;
    kv)
        [ -n "$b90" ] && [ -n "$tmp" ] || continue
        step kv_bench 170 "$b90/bench/bench_gpu" --device cuda:0 --shapes "$shape" --types q4_k_m \
            --kv-type f16,q8_0 --batches 1,64 --ctx 2048 --prompt 512 --steps 5 --warmup 2 --prefill-reps 2 \
            --capacity-budget 16G --capacity-ctx 2048 --tmpdir "$tmp" --json "$out/kv_bench.json"
        rm -rf "$tmp"/bench_gpu_*
        ;;
    cluster)
        [ -n "$b90" ] && cluster_model || continue
        layouts=1x1,1x2,1x2s,2x1
        [ "$gpus" -ge 2 ] || layouts=1x1
        cluster cluster_bench 300 "$layouts" --concurrency 64,128 --prompt-tokens 128 \
            --max-tokens "${LLM_SESSION_GEN:-64}"
        ;;
    link)
        [ -n "$b90" ] || continue
        step link 90 "$b90/tests/test_link"
        [ -x "$b90/tests/test_node_stages" ] && step node_stages 120 "$b90/tests/test_node_stages"
        ;;
    c1)
        # What a second stage costs one stream: 1x1 and 1x2 in turn, twice,
        # so that the host's drift falls on both alike.
        [ -n "$b90" ] && cluster_model || continue
        [ "$gpus" -ge 2 ] || { note "SKIP c1: one GPU"; continue; }
        cluster c1_bench 240 1x1,1x2,1x1,1x2 --concurrency 1 --requests 32 --prompt-tokens 128 --max-tokens 128
        ;;
    c1spin)
        # The same with the router and the workers polling before they
        # block (each --spin-us of LLM_SESSION_C1_SPINS, "-1 0"; -1 is auto,
        # the default, 0 blocks at once), in turn, LLM_SESSION_C1_ROUNDS times
        # (docs/worker.md, "Polling before blocking").
        [ -n "$b90" ] && cluster_model || continue
        [ "$gpus" -ge 2 ] || { note "SKIP c1spin: one GPU"; continue; }
        for r in $(seq "${LLM_SESSION_C1_ROUNDS:-2}"); do
            for s in ${LLM_SESSION_C1_SPINS:--1 0}; do
                cluster "c1spin_${s}_$r" 120 1x1,1x2 --concurrency 1 --requests 32 --prompt-tokens 128 \
                    --max-tokens 128 --router-args "--spin-us $s" --worker-args "--spin-us $s"
            done
        done
        ;;
    timeline)
        # The same at debug level, its run dirs kept: where a step's time
        # goes between the router and each stage (scripts/step-timeline.py),
        # once for each --spin-us of LLM_SESSION_TIMELINE_SPINS ("0").
        [ -n "$b90" ] && cluster_model || continue
        tl=1x1,1x2
        [ "$gpus" -ge 2 ] || { tl=1x1; note "timeline: one GPU, 1x1 only"; }
        : >"$out/timeline.txt"
        i=0
        for s in ${LLM_SESSION_TIMELINE_SPINS:-0}; do
            i=$((i + 1))
            runs=$out/timeline-runs/$i-spin$s
            mkdir -p "$runs"
            step "timeline_${i}_spin${s}_bench" 150 "$b90/bench/bench_cluster" --model "$model" --device auto --layouts $tl \
                --concurrency 1 --requests 16 --prompt-tokens 128 --max-tokens 128 --log-level debug --up-timeout-s 120 \
                --up-tries 1 --tmpdir "$tmp" --run-root "$runs" --router-args "--spin-us $s" --worker-args "--spin-us $s"
            for d in "$runs"/*/; do
                [ -d "$d" ] && "$b90/router/llm-cluster" down --run-dir "$d" >/dev/null 2>&1
            done
            echo "run $i: --spin-us $s" >>"$out/timeline.txt"
            env -u LD_LIBRARY_PATH python3 scripts/step-timeline.py --tokens 1 "$runs"/1x* >>"$out/timeline.txt" 2>&1
        done
        tar -czf "$out/timeline-runs.tar.gz" -C "$out" timeline-runs 2>/dev/null && rm -rf "${out:?}/timeline-runs"
        ;;
    prefix)
        [ -n "$b90" ] && cluster_model || continue
        cluster prefix_bench 110 1x1 --shared-prefix "${LLM_SESSION_PREFIX:-1024}" --question-tokens 32 --requests 64 --concurrency 16 \
            --max-tokens 64
        ;;
    wait)
        [ -n "$b90" ] && cluster_model || continue
        w="--batch-wait-us ${LLM_SESSION_WAIT_US:-1000}"
        cluster wait_prefix_bench 110 1x1 --shared-prefix "${LLM_SESSION_PREFIX:-1024}" --question-tokens 32 \
            --requests 64 --concurrency 16 --max-tokens 64 --router-args "$w"
        cluster wait_c1_off_bench 60 1x1 --concurrency 1 --requests 24 --prompt-tokens 128 --max-tokens 64
        cluster wait_c1_on_bench 60 1x1 --concurrency 1 --requests 24 --prompt-tokens 128 --max-tokens 64 \
            --router-args "$w"
        ;;
    itl)
        [ -n "$b90" ] && cluster_model || continue
        il=${LLM_SESSION_ITL_LAYOUT:-1x1}
        [ "$gpus" -ge 2 ] || il=1x1
        cluster itl_default_bench 90 "$il" --concurrency 64 --requests 256 --prompt-tokens 128 --max-tokens 128
        cluster itl_steps1024_bench 90 "$il" --concurrency 64 --requests 256 --prompt-tokens 128 --max-tokens 128 \
            --worker-args "--max-batch-tokens 1024"
        cluster itl_tuned_bench 90 "$il" --concurrency 64 --requests 256 --prompt-tokens 128 --max-tokens 128 \
            --worker-args "--max-seqs 64" --router-args "--itl-target-ms 0"
        ;;
    gateway)
        [ -n "$b90" ] && cluster_model || continue
        OUT="$out/gateway" LLM_BENCH_BUILD="$b90" LLM_GW_BENCH_MODEL="$model" TMPDIR="$tmp" \
            step gateway_bench 300 ./scripts/gateway-bench.sh
        ;;
    *) note "gpu-session: unknown step '$what' (tests, t4, link, kv, cluster, c1, c1spin, timeline, prefix, wait, itl, gateway)"; status=2 ;;
    esac
done
[ -n "$model" ] && [ -z "${LLM_SESSION_KEEP_MODEL:-}" ] && rm -f "$model"
rm -rf "$tmp"/bench_cluster_* 2>/dev/null

# The tables, then the summary.
for f in kv_bench cluster_bench c1_bench prefix_bench wait_prefix_bench wait_c1_off_bench wait_c1_on_bench itl_default_bench \
    itl_steps1024_bench itl_tuned_bench $(cd "$out" && ls c1spin_*.log 2>/dev/null | sed 's/\.log$//'); do
    [ -f "$out/$f.log" ] || continue
    echo "=== $f"
    if [ "$f" = kv_bench ]; then
        grep -E "^shape|decode|prefill|^capacity" "$out/$f.log" | grep -v "^bench_gpu"
    else
        grep -E "^\||^##" "$out/$f.log"
    fi
done
if ls "$out"/c1spin_*_*.json >/dev/null 2>&1; then
    echo "=== c1spin: the second stage's cost (scripts/c1-cost.py)"
    env -u LD_LIBRARY_PATH python3 scripts/c1-cost.py "$out"
fi
if [ -f "$out/timeline.txt" ]; then
    echo "=== timeline"
    cat "$out/timeline.txt"
fi
if [ -f "$out/gateway/summary.txt" ]; then
    echo "=== gateway_bench"
    cat "$out/gateway/summary.txt"
fi
echo "=== summary ($(( $(date +%s) - t_start )) s)"
cat "$summary"
exit $status
