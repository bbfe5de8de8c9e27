#!/bin/sh
# Installs the dependencies, builds everything and runs every test through
# ctest, which prints a line per test as it finishes and then its summary;
# a program that skipped all its tests (no GPU, say) shows as Skipped, and
# why is printed after the summary.
#   LLM_CUDA_ARCHITECTURES=75 ./scripts/test.sh   # also build CUDA for sm_75
#   LLM_TEST_LABEL=quick ./scripts/test.sh        # only the quick tests
set -eu
cd "$(dirname "$0")/.."
./scripts/build.sh
cd build
set -- --output-on-failure --no-label-summary -j "$(nproc)"
if [ -n "${LLM_TEST_LABEL:-}" ]; then
    echo "== tests labelled $LLM_TEST_LABEL (ctest, $(nproc) at a time)"
    set -- "$@" -L "$LLM_TEST_LABEL"
else
    echo "== tests (ctest, $(nproc) at a time)"
fi
rc=0
ctest "$@" || rc=$?
# tests/test.c ends an all-skipped program's output with "all N tests
# skipped (last reason: ...)"; ctest keeps the output in LastTest.log.
log=Testing/Temporary/LastTest.log
[ ! -f "$log" ] || awk '/^[0-9]+\/[0-9]+ Test: / { name = $3 }
    /^all [0-9]+ tests skipped/ { print "skipped: " name ": " $0 }' "$log"
exit "$rc"
