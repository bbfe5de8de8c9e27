#!/bin/sh
# Builds the libFuzzer harnesses of tests/fuzz with clang (ASan + UBSan) and
# runs one of them for a bounded time from its seed corpus.  The tests
# labelled "fuzz" run every harness this way (15 s each); run one longer by
# hand to look for more:
#   ./scripts/fuzz.sh gguf              # 15 s (LLM_FUZZ_SECONDS overrides)
#   ./scripts/fuzz.sh gguf 600          # ten minutes
#   ./scripts/fuzz.sh gguf 0            # until stopped (Ctrl-C)
#   ./scripts/fuzz.sh --build           # build only
#   ./scripts/fuzz.sh --list            # the harness names
# Further arguments after the time go to libFuzzer (-jobs=2, -dict=FILE,
# -max_len=N); to reproduce a crash run the harness on its file
# (build/fuzz/fuzz_NAME FILE).  The build goes to build/fuzz
# (LLM_FUZZ_BUILD_DIR overrides), new inputs the fuzzer finds to
# build/fuzz/corpus/NAME, crashes to build/fuzz/crashes/; docs/testing.md
# says more.  Without clang's libFuzzer it exits 77 (skipped) and says so.
set -eu
cd "$(dirname "$0")/.."
root=$(pwd)
bdir=${LLM_FUZZ_BUILD_DIR:-$root/build/fuzz}
names=$(cd tests/fuzz && ls fuzz_*.c | sed -n 's/^fuzz_\(.*\)\.c$/\1/p' | grep -v -x -e util -e seeds)

skip() {
    # The wording test.sh looks for to say why a test program skipped.
    echo "all 1 tests skipped (last reason: $*)"
    exit 77
}

case "${1:-}" in
--list) echo "$names"; exit 0 ;;
--build) ;;
"") echo "usage: $0 NAME [SECONDS [libFuzzer args...]] | --build | --list" >&2; exit 2 ;;
*)
    echo "$names" | grep -q -x -e "$1" || { echo "fuzz.sh: no harness \"$1\" (have: $(echo $names))" >&2; exit 2; }
    ;;
esac

cc=${LLM_FUZZ_CC:-clang}
command -v "$cc" >/dev/null 2>&1 ||
    skip "no $cc: the fuzzers need clang with libFuzzer (Debian: apt-get install clang libclang-rt-14-dev)"
mkdir -p "$bdir"
probe="$bdir/probe"
printf '#include <stddef.h>\n#include <stdint.h>\nint LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { (void)d; (void)n; return 0; }\n' >"$probe.c"
"$cc" -fsanitize=fuzzer,address,undefined "$probe.c" -o "$probe" >"$probe.log" 2>&1 ||
    skip "$cc cannot link -fsanitize=fuzzer,address,undefined (Debian: apt-get install libclang-rt-14-dev, or the libclang-rt-N-dev of clang-N); $(head -c 300 "$probe.log" | tr '\n' ' ')"

# One build at a time: ctest runs several of these tests at once, and the
# first to get the lock builds while the others wait for it, then find
# nothing left to do.
(
    flock 9
    if [ ! -f "$bdir/CMakeCache.txt" ]; then
        echo "fuzz.sh: configuring $bdir with $cc"
        CC=$cc cmake -S tests/fuzz -B "$bdir" -DCMAKE_BUILD_TYPE=RelWithDebInfo >"$bdir/configure.log" 2>&1 ||
            { cat "$bdir/configure.log"; exit 1; }
    fi
    cmake --build "$bdir" -j "$(nproc)" >"$bdir/build.log" 2>&1 || { cat "$bdir/build.log"; exit 1; }
    rm -rf "$bdir/seeds"
    "$bdir/fuzz_seeds" "$bdir/seeds"
) 9>"$bdir.lock"
[ "$1" = --build ] && { echo "fuzz.sh: built in $bdir"; exit 0; }

name=$1
secs=${2:-${LLM_FUZZ_SECONDS:-15}}
[ $# -ge 2 ] && shift 2 || shift $#
work="$bdir/corpus/$name"
crashes="$bdir/crashes"
mkdir -p "$work" "$crashes"
# libFuzzer adds what it finds to the first folder and only reads the
# others: the committed seeds, the generated ones, and pieces of the test
# models when ../shared/models is there.
set -- "$work" "$@"
[ -d "tests/fuzz/corpus/$name" ] && set -- "$@" "tests/fuzz/corpus/$name"
[ -d "$bdir/seeds/$name" ] && set -- "$@" "$bdir/seeds/$name"
models=${LLM_MODELS_DIR:-$root/../shared/models}
extra="$bdir/models/$name"
rm -rf "$extra"
mkdir -p "$extra"
if [ -d "$models" ]; then
    case $name in
    gguf) files="stories260K-q4_0.gguf" ;;
    hf_config) files="tiny-llama-hf/config.json" ;;
    tokenize) files="vocab/ggml-vocab-gpt-2.gguf.inp vocab/ggml-vocab-llama-spm.gguf.inp" ;;
    *) files="" ;;
    esac
    for f in $files; do
        [ -f "$models/$f" ] && ln -sf "$models/$f" "$extra/$(echo "$f" | tr / _)"
    done
fi
set -- "$@" "$extra"

echo "fuzz.sh: fuzz_$name for ${secs}s from $(for d in "$@"; do case $d in -*) ;; *) printf '%s ' "${d#"$root"/}";; esac; done)"
# libFuzzer's own exit code for a crash is 77, which ctest reads as skipped.
ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0} \
UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1} \
"$bdir/fuzz_$name" -max_total_time="$secs" -rss_limit_mb=2048 -timeout=20 -error_exitcode=1 \
    -timeout_exitcode=1 -print_final_stats=1 -artifact_prefix="$crashes/$name-" "$@" && exit 0
rc=$?
echo "fuzz.sh: fuzz_$name failed (exit $rc); the input is in $crashes/ (name above); reproduce with"
echo "  $bdir/fuzz_$name $crashes/$name-<file>"
exit 1
