#!/bin/sh
# The main job: installs the dependencies, builds, starts a local cluster
# (a private redis-server unless REDIS_URL is given, one router, one 2-stage
# worker pipeline on the CPU backend or on GPUs when present), streams one
# generate request through the `llm` client, then stops what it started.
#   MODEL=path/to/model.gguf PROMPT="Once upon a time" ./scripts/run.sh
# Without MODEL it uses ../shared/models/stories260K-f32.gguf (a tiny model
# trained on children's stories) when that file is there, and otherwise
# writes a small synthetic model (random weights: the text is meaningless,
# but every part of the cluster runs).
set -eu
cd "$(dirname "$0")/.."
./scripts/build.sh programs
bin=build
prompt=${PROMPT:-Once upon a time}
model=${MODEL:-}
stories=../shared/models/stories260K-f32.gguf
echo "== model"
if [ -n "$model" ]; then
    echo "run.sh: MODEL=$model"
elif [ -f "$stories" ]; then
    model=$stories
    echo "run.sh: no MODEL given: using $model (a tiny story model, so expect simple English)"
else
    model=run/models/synth-tiny-f16.gguf
    echo "run.sh: no MODEL given and no $stories: using the synthetic $model"
    echo "run.sh: (random weights, so the text is meaningless; MODEL=path.gguf picks a real model)"
    if [ ! -f "$model" ]; then
        mkdir -p run/models
        "$bin/worker/llm-synth" --shape tiny --type f16 --out "$model"
    fi
fi
echo "== cluster: redis-server, a router and a pipeline of 2 worker stages (logs in run/cluster)"
rundir=run/cluster
up_args="--model $model --pipelines 1 --stages 2 --run-dir $rundir"
[ -n "${REDIS_URL:-}" ] && up_args="$up_args --redis $REDIS_URL"
# shellcheck disable=SC2086
"$bin/router/llm-cluster" up $up_args
trap 'echo "== stopping the cluster"; "$bin/router/llm-cluster" down --run-dir "$rundir"' EXIT INT TERM
"$bin/router/llm-cluster" status --run-dir "$rundir"
endpoint=$(cat "$rundir/endpoint")
echo "== generating from \"$prompt\" through $endpoint"
# env.sh: the router's endpoint and the client's CURVE keys that up made.
# shellcheck disable=SC1091
. "$rundir/env.sh"
"$bin/clients/c/llm" generate --prompt "$prompt" --max-tokens "${MAX_TOKENS:-64}"
echo
