#!/bin/sh
# The main job: installs the dependencies, builds, starts a local cluster
# (a private redis-server unless REDIS_URL is given, one router, one 2-stage
# worker pipeline on the CPU backend or on GPUs when present), streams one
# generate request through the `llm` client, then stops what it started.
#   MODEL=path/to/model.gguf PROMPT="Once upon a time" ./scripts/run.sh
# Without MODEL it writes and uses a small synthetic model (random weights:
# the text is meaningless, but every part of the cluster runs).
set -eu
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
archs=${LLM_CUDA_ARCHITECTURES:-75;80;86;89;90}
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DLLM_CUDA_ARCHITECTURES=$archs" >build.log 2>&1 ||
    { cat build.log; exit 1; }
cmake --build build -j "$(nproc)" --target llm-run llm-synth llm-router llm-worker llm llm-cluster \
    >>build.log 2>&1 || { tail -n 60 build.log; exit 1; }
bin=build
prompt=${PROMPT:-Once upon a time}
model=${MODEL:-}
if [ -z "$model" ]; then
    model=run/models/synth-tiny-f16.gguf
    if [ ! -f "$model" ]; then
        mkdir -p run/models
        "$bin/worker/llm-synth" --shape tiny --type f16 --out "$model"
    fi
    echo "run.sh: no MODEL given: using $model (random weights, so the text is meaningless;"
    echo "run.sh: MODEL=../shared/models/stories260K-f32.gguf gives a small trained model)"
fi
rundir=run/cluster
up_args="--model $model --pipelines 1 --stages 2 --run-dir $rundir"
[ -n "${REDIS_URL:-}" ] && up_args="$up_args --redis $REDIS_URL"
# shellcheck disable=SC2086
"$bin/router/llm-cluster" up $up_args
trap '"$bin/router/llm-cluster" down --run-dir "$rundir"' EXIT INT TERM
"$bin/router/llm-cluster" status --run-dir "$rundir"
endpoint=$(cat "$rundir/endpoint")
echo "--- generating from \"$prompt\" through $endpoint"
"$bin/router/llm" --router "$endpoint" generate --prompt "$prompt" --max-tokens "${MAX_TOKENS:-64}"
echo
