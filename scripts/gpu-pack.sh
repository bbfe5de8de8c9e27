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
# LLM_PACK_ALSO="/abs/build-gpu75 ..." packs the same binaries of more
# build folders into the same file, and LLM_PACK_AB=1 the builds that
# scripts/gpu-ab.sh saved (build-ab/, unpacked at /build-ab, where
# gpu-ab.sh run finds them): one xz stream, each folder's binaries beside
# its gpu-ab.sh builds, so that xz -9 stores the kernels they share once
# (tests of both builds, the models and four bench_gpu: 40 MB where three
# packs took 52):
#   XZ_OPT="-9 -T2" LLM_PACK_ALSO=$PWD/build-gpu75 LLM_PACK_AB=1 LLM_PACK_BINS="tests/test_cuda_ops" \
#       scripts/gpu-pack.sh $PWD/build-gpu90 ../shared/models gpu-pack/all.tar.xz
#   on the GPU host: tar -xJf gpu-pack/all.tar.xz -C /
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
also=""
for b in ${LLM_PACK_ALSO:-}; do also="$also $(cd "$b" && pwd)"; done
bins=${LLM_PACK_BINS:-tests/test_cuda_ops tests/test_cuda_attention tests/test_cuda_sample tests/test_forward tests/test_link tests/test_node \
    tests/test_node_stages tests/test_node_plans tests/test_kv_q8 worker/llm-run worker/llm-worker worker/llm-synth \
    router/llm-router router/llm-cluster clients/c/llm gateway/llm-gateway bench/bench_gpu bench/bench_cluster bench/bench_mma}
list=$stage/files
echo build.path >"$list"
if [ -n "$models" ]; then
    mkdir -p "$stage$build"
    cp -r "$models" "$stage$build/models"
    (cd "$stage" && find "${build#/}/models" ! -type d) >>"$list"
fi
for bd in $build $also; do
    mkdir -p "$stage$bd"
    for b in $bins; do
        [ -e "$bd/$b" ] || { echo "gpu-pack: $bd/$b is not built; left out" >&2; continue; }
        mkdir -p "$stage$bd/$(dirname "$b")"
        strip -o "$stage$bd/$b" "$bd/$b"
        echo "${bd#/}/$b" >>"$list"
    done
    # libcjson, which the runtime bundle (.deps) lacks, when the build has it.
    [ -d "$bd/rt" ] && cp -r "$bd/rt" "$stage$bd/rt" && (cd "$stage" && find "${bd#/}/rt" ! -type d) >>"$list"
    if [ -n "${LLM_PACK_AB:-}" ]; then
        [ -d build-ab ] || { echo "gpu-pack: LLM_PACK_AB: nothing saved (scripts/gpu-ab.sh save)" >&2; exit 1; }
        for d in build-ab/*-"$(basename "$bd")"; do
            [ -d "$d" ] || continue
            mkdir -p "$stage/build-ab"
            cp -r "$d" "$stage/build-ab/"
            (cd "$stage" && find "$d" ! -type d) >>"$list"
        done
    fi
done
echo "$build" >"$stage/build.path"
tar -C "$stage" -cJf "$pack" --no-recursion -T "$list"
ls -l "$pack"
