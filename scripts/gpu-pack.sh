#!/bin/bash
# Packs what scripts/gpu-check.sh and scripts/gpu-session.sh need on a GPU
# host into gpu-pack/pack.tar.xz (or the file named third, relative to the
# repository root; the scripts read LLM_GPU_PACK): the GPU test and
# benchmark binaries of a build folder (at their absolute path, which the
# tests have compiled in) and the test models.
#   scripts/gpu-pack.sh /abs/path/to/build-gpu [../shared/models] [gpu-pack/other.tar.xz]
# Packs of different build folders unpack side by side (each under its own
# path), so an sm_90 pack and a 75-virtual pack can travel together:
#   scripts/gpu-pack.sh $PWD/build-gpu90 ../shared/models gpu-pack/sm90.tar.xz
#   LLM_PACK_BINS="tests/test_cuda_ops tests/test_cuda_attention tests/test_cuda_sample tests/test_forward" \
#       scripts/gpu-pack.sh $PWD/build-gpu75 - gpu-pack/sm75.tar.xz
# A models argument of "-" packs no models (the other pack's serve both:
# LLM_MODELS_DIR).  LLM_PACK_BINS replaces the list of binaries.
set -eu
build=$(cd "$1" && pwd)
models_arg=${2:-$(dirname "$0")/../../shared/models}
models=""
[ "$models_arg" = "-" ] || models=$(cd "$models_arg" && pwd)
cd "$(dirname "$0")/.."
pack=${3:-gpu-pack/pack.tar.xz}
mkdir -p "$(dirname "$pack")"
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage$build"
bins=${LLM_PACK_BINS:-tests/test_cuda_ops tests/test_cuda_attention tests/test_cuda_sample tests/test_forward tests/test_link tests/test_node \
    tests/test_node_stages tests/test_node_plans tests/test_kv_q8 worker/llm-run worker/llm-worker worker/llm-synth \
    router/llm-router router/llm-cluster clients/c/llm gateway/llm-gateway bench/bench_gpu bench/bench_cluster bench/bench_mma}
for b in $bins; do
    [ -e "$build/$b" ] || { echo "gpu-pack: $build/$b is not built; left out" >&2; continue; }
    mkdir -p "$stage$build/$(dirname "$b")"
    strip -o "$stage$build/$b" "$build/$b"
done
# libcjson, which the runtime bundle (.deps) lacks, when the build has it.
[ -d "$build/rt" ] && cp -r "$build/rt" "$stage$build/rt"
[ -n "$models" ] && cp -r "$models" "$stage$build/models"
echo "$build" >"$stage/build.path"
tar -C "$stage" -cJf "$pack" build.path "${build#/}"
ls -l "$pack"
