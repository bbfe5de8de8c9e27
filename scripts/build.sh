#!/bin/sh
# Installs the dependencies, configures build/ and builds the targets named
# (all without any), printing each step and the build's progress; the full
# compiler output goes to build.log.  run.sh and test.sh start with it.
#   ./scripts/build.sh                      # everything
#   ./scripts/build.sh programs             # only the programs (CMakeLists.txt)
#   LLM_CUDA_ARCHITECTURES=75 ./scripts/build.sh   # CUDA for sm_75 (no GPU needed)
# Without LLM_CUDA_ARCHITECTURES the CUDA backend is built for the GPUs
# present, and not at all when there is none (CMakeLists.txt says why).
set -eu
cd "$(dirname "$0")/.."
log=build.log

echo "== dependencies"
deps_start=$(date +%s)
./scripts/install-deps.sh
# The build's time, printed at the end, counts configure and compile only; a
# first run's package installs are counted apart.
start=$(date +%s)
deps_s=$((start - deps_start))

echo "== configure (build/, log in $log)"
# Passed every time, so that a build/ configured before follows the
# environment of this run rather than its cache.
if ! cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo \
        "-DLLM_CUDA_ARCHITECTURES=${LLM_CUDA_ARCHITECTURES:-}" >"$log" 2>&1; then
    cat "$log"
    exit 1
fi
sed -n 's/^-- \(CUDA backend: .*\)/\1/p' "$log"

jobs=$(nproc)
if [ $# -gt 0 ]; then
    echo "== build: $* ($jobs jobs)"
    set -- --target "$@"
else
    echo "== build: everything ($jobs jobs)"
fi
# The compiler's output goes to the log; the terminal gets one line each
# time make's percentage moves, naming the file it started on (a CUDA file
# can take a minute, and this shows which one).  The exit status travels
# through a file because sh has no pipefail.
rcfile=$(mktemp)
trap 'rm -f "$rcfile"' EXIT
{ cmake --build build -j "$jobs" "$@" 2>&1; echo $? >"$rcfile"; } | tee -a "$log" | awk '
    /^\[ *[0-9]+%\] (Building|Linking)/ {
        pct = $0; sub(/\].*/, "]", pct)
        if (pct == last) next
        last = pct
        what = $0; sub(/^\[ *[0-9]+%\] /, "", what)
        # "Building C object common/CMakeFiles/llmcommon.dir/gguf.c.o" -> "compiling common/gguf.c"
        if (what ~ /^Building/) {
            lang = what; sub(/^Building /, "", lang); sub(/ object.*/, "", lang)
            sub(/^Building [A-Z+]+ object /, "", what)
            sub(/CMakeFiles\/[^\/]*\.dir\//, "", what); sub(/\.o$/, "", what)
            gsub(/__\//, "../", what)
            what = "compiling " what (lang == "CUDA" ? " (CUDA)" : "")
        } else {
            sub(/^Linking [A-Z+]+ (static library|executable|shared library) /, "", what)
            what = "linking " what
        }
        printf "build %s %s\n", pct, what
        fflush()
    }'
rc=$(cat "$rcfile")
if [ "$rc" -ne 0 ]; then
    echo "== build failed (exit $rc); the errors, from $log:"
    grep -E "error|Error" "$log" | head -n 40
    echo "--- last lines of $log:"
    tail -n 30 "$log"
    exit 1
fi
echo "== build done in $(($(date +%s) - start)) s (configure and compile; the dependencies took $deps_s s before)"
