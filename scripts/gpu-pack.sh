#!/bin/bash
# Packs what scripts/gpu-check.sh needs on a GPU host into gpu-pack/pack.tar.xz
# (or the file named third, relative to the repository root; gpu-check.sh
# reads LLM_GPU_PACK): the GPU test and benchmark binaries of a build folder
# (at their absolute path, which the tests have compiled in) and the test models.
#   scripts/gpu-pack.sh /abs/path/to/build-gpu [../shared/models] [gpu-pack/other.tar.xz]
set -eu
build=$(cd "$1" && pwd)
models=$(cd "${2:-$(dirname "$0")/../../shared/models}" && pwd)
cd "$(dirname "$0")/.."
pack=${3:-gpu-pack/pack.tar.xz}
mkdir -p "$(dirname "$pack")"
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage$build"
for b in tests/test_cuda_ops tests/test_cuda_sample tests/test_forward tests/test_link tests/test_node worker/llm-run \
         worker/llm-worker router/llm-router router/llm-cluster bench/bench_gpu bench/bench_cluster; do
    [ -e "$build/$b" ] || { echo "gpu-pack: $build/$b is not built; left out" >&2; continue; }
    mkdir -p "$stage$build/$(dirname "$b")"
    strip -o "$stage$build/$b" "$build/$b"
done
cp -r "$models" "$stage$build/models"
echo "$build" >"$stage/build.path"
tar -C "$stage" -cJf "$pack" build.path "${build#/}"
ls -l "$pack"
