#!/bin/bash
# Old against new across builds, in one GPU call: the bench_gpu of every
# saved build runs in turn, round after round, so that the lent machine's
# drift (clocks, a neighbour) falls on every build alike.  One build's
# knobs are compared with bench_gpu --ab instead; this is for code changes.
#
# Here, with the build tools:
#   scripts/gpu-ab.sh save TAG [BUILD_DIR...]
#       copies the stripped bench_gpu (and rt/) of each build folder
#       (default: build-gpu90 build-gpu75) into build-ab/TAG-<folder>,
#       noting whether it is a 75-virtual build (then run as LLM_CUDA_SM=75)
#   scripts/gpu-ab.sh pack
#       packs build-ab/ into gpu-pack/ab.tar.xz (XZ_OPT="-9 -T2": the
#       kernels the builds share compress away); with test binaries too,
#       gpu-pack.sh's LLM_PACK_AB packs both in one stream (/build-ab)
#   scripts/gpu-ab.sh clear
# On the GPU host (the repository root of the call, .deps/env.sh sourced):
#   scripts/gpu-ab.sh run [ROUNDS] -- BENCH_GPU_ARGS...
#       unpacks gpu-pack/ab.tar.xz when build-ab/ is not there, then ROUNDS
#       (2) rounds of every saved build (each synthetic model written once
#       into $TMPDIR/gpu-ab-models and reused by every run of a build whose
#       bench_gpu has --model-cache); prints one line a decode row
#       (build, round, shape, batch, context, ms; with --verify K also the
#       K + 1-token step as batch "kK+1") and then, per build, shape and
#       batch, the range over the rounds.
# Example (the sequence of a kernel change):
#   scripts/gpu-ab.sh save old; <edit, rebuild>; scripts/gpu-ab.sh save new
#   scripts/gpu-ab.sh pack
#   run: . .deps/env.sh; scripts/gpu-ab.sh run 2 -- --shapes llama2-7b --types q4_k_m --batches 8,16 --ctx 512
set -u
cd "$(dirname "$0")/.." || exit 2
ab=build-ab
cmd=${1:-}
[ $# -gt 0 ] && shift
case $cmd in
save)
    tag=${1:?usage: gpu-ab.sh save TAG [BUILD_DIR...]}
    shift
    [ $# -gt 0 ] || set -- build-gpu90 build-gpu75
    for b in "$@"; do
        [ -x "$b/bench/bench_gpu" ] || { echo "gpu-ab: $b/bench/bench_gpu is not built" >&2; exit 1; }
        d=$ab/$tag-$(basename "$b")
        rm -rf "$d"
        mkdir -p "$d/bench"
        strip -o "$d/bench/bench_gpu" "$b/bench/bench_gpu" || exit 1
        [ -d "$b/rt" ] && cp -r "$b/rt" "$d/rt"
        sm=""
        grep -q '^LLM_CUDA_ARCHITECTURES:STRING=75-virtual' "$b/CMakeCache.txt" 2>/dev/null && sm=75
        echo "$sm" >"$d/sm"
        echo "gpu-ab: saved $d${sm:+ (run as LLM_CUDA_SM=$sm)}"
    done
    ;;
pack)
    [ -d $ab ] || { echo "gpu-ab: nothing saved ($ab/)" >&2; exit 1; }
    mkdir -p gpu-pack
    tar -cJf gpu-pack/ab.tar.xz $ab && ls -l gpu-pack/ab.tar.xz
    ;;
clear) rm -rf $ab gpu-pack/ab.tar.xz ;;
run)
    rounds=2
    [ $# -gt 0 ] && [ "$1" != "--" ] && { rounds=$1; shift; }
    [ "${1:-}" = "--" ] && shift
    if [ ! -d $ab ]; then # unpacked from gpu-pack.sh's LLM_PACK_AB, or ours
        if [ -d /build-ab ]; then ab=/build-ab; else tar -xJf gpu-pack/ab.tar.xz || exit 1; fi
    fi
    rows=$(mktemp)
    trap 'rm -f "$rows"' EXIT
    cache=${TMPDIR:-/tmp}/gpu-ab-models
    for r in $(seq "$rounds"); do
        for d in $ab/*/; do
            d=${d%/}
            keep=()
            "$d/bench/bench_gpu" --help 2>&1 | grep -q -- '--model-cache' && keep=(--model-cache "$cache")
            LD_LIBRARY_PATH="$d/rt${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" LLM_CUDA_SM=$(cat "$d/sm") \
                timeout 300 "$d/bench/bench_gpu" --tmpdir "${TMPDIR:-/tmp}" "${keep[@]}" "$@" 2>&1 |
                awk -v b="$(basename "$d")" -v r="$r" '$3 == "decode" {print b, r, $1, $5, $6, $8}
                    $8 ~ /^[0-9.]+x$/ {print b, r, $1, "k" $5 "+1", $4, $7}' | tee -a "$rows"
        done
    done
    echo "== build, shape, batch, context: ms over $rounds rounds (min-max)"
    awk '{k = $1 " " $3 " " $4 " " $5; if (!(k in lo) || $6 < lo[k]) lo[k] = $6; if ($6 > hi[k]) hi[k] = $6}
         END {for (k in lo) print k, lo[k] "-" hi[k]}' "$rows" | sort -k2,2 -k3,3n -k1,1
    ;;
*)
    sed -n '2,29p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
