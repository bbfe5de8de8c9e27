#!/bin/bash
# The GPU checks the CI machine cannot run, for a lent GPU host that has no
# build tools: unpacks binaries built elsewhere (pack.tar.xz, made by
# scripts/gpu-pack.sh), then runs what its argument names and keeps every log
# under $OUT.
#   tests   the CUDA op tests against the CPU backend, the forward pass on
#           the GPU against the goldens, the NCCL link and a 2-GPU pipeline
#   cluster scripts/cluster-bench.sh (1 vs 2 stages, router overhead)
#   model   scripts/gpu-bench.sh (decode and prefill of 1.1B and 7B shapes)
#   t4      the CUDA op, sampling and forward tests routed as sm_75
#           (LLM_CUDA_SM=75); from a pack of a build configured with
#           -DLLM_CUDA_ARCHITECTURES=75-virtual the driver compiles the T4's
#           own kernel code for this card, so a newer GPU runs the T4's paths
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
. .deps/env.sh
pack=${LLM_GPU_PACK:-gpu-pack/pack.tar.xz}
build=$(tar -xJf "$pack" -O build.path)
if [ ! -x "$build/tests/test_cuda_ops" ]; then
    tar -xJf "$pack" -C / --exclude=build.path
fi
export LLM_MODELS_DIR=${LLM_MODELS_DIR:-$build/models}
nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv >"$out/machine.txt" 2>&1
cat "$out/machine.txt"

status=0
step() {
    name=$1
    shift
    echo "=== $name" >&2
    timeout --kill-after=10 "$@" >"$out/$name.log" 2>&1
    rc=$?
    grep -E "^\[ (FAIL|SKIP) \]|tests: |skipped:" "$out/$name.log" | tail -n 12
    [ $rc -eq 0 ] || { echo "$name: exit status $rc" >&2; tail -n 30 "$out/$name.log" >&2; status=1; }
}
for what in "$@"; do
    case $what in
    tests)
        step cuda_ops 180 "$build/tests/test_cuda_ops"
        step cuda_attention 180 "$build/tests/test_cuda_attention"
        [ -x "$build/tests/test_cuda_sample" ] && step cuda_sample 120 "$build/tests/test_cuda_sample"
        LLM_TEST_DEVICE=cuda:0 step forward_gpu 120 "$build/tests/test_forward"
        step link 120 "$build/tests/test_link"
        step node 240 "$build/tests/test_node"
        step node_stages 240 "$build/tests/test_node_stages"
        step node_plans 240 "$build/tests/test_node_plans"
        ;;
    t4)
        LLM_CUDA_SM=75 step cuda_ops_sm75 300 "$build/tests/test_cuda_ops"
        LLM_CUDA_SM=75 step cuda_attention_sm75 300 "$build/tests/test_cuda_attention"
        LLM_CUDA_SM=75 step cuda_sample_sm75 120 "$build/tests/test_cuda_sample"
        LLM_CUDA_SM=75 LLM_TEST_DEVICE=cuda:0 step forward_gpu_sm75 120 "$build/tests/test_forward"
        ;;
    cluster)
        LLM_BENCH_BUILD=$build OUT=$out/cluster step cluster_bench 280 ./scripts/cluster-bench.sh
        tail -n 20 "$out/cluster_bench.log"
        ;;
    model)
        LLM_BENCH_BIN=$build/bench/bench_gpu OUT=$out/model step model_bench 420 ./scripts/gpu-bench.sh
        tail -n 40 "$out/model_bench.log"
        ;;
    *) echo "gpu-check: unknown step '$what' (tests, t4, cluster, model)" >&2; exit 2 ;;
    esac
done
exit $status
