#!/bin/sh
# Installs the dependencies, builds everything and runs every test through
# ctest.  ctest's summary is the last thing printed.
#   LLM_CUDA_ARCHITECTURES=75 ./scripts/test.sh   # build CUDA for sm_75 only
#   LLM_TEST_LABEL=quick ./scripts/test.sh        # only the quick tests
set -eu
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
archs=${LLM_CUDA_ARCHITECTURES:-75;80;86;89;90}
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DLLM_CUDA_ARCHITECTURES=$archs" >build.log 2>&1 ||
    { cat build.log; exit 1; }
grep -E "CUDA backend" build.log || true
cmake --build build -j "$(nproc)" >>build.log 2>&1 || { tail -n 60 build.log; exit 1; }
cd build
if [ -n "${LLM_TEST_LABEL:-}" ]; then
    exec ctest --output-on-failure --no-label-summary -L "$LLM_TEST_LABEL" -j "$(nproc)"
fi
exec ctest --output-on-failure --no-label-summary -j "$(nproc)"
