#!/bin/bash
# One stream's tokens/s with speculation off and by prompt lookup (ngram),
# greedy, on a local 1x1 cluster (docs/router.md, "Speculation"): each
# prompt is the head of a Python file, run once per mode; the router's
# llm_spec_* counters give the acceptance.  The outputs of both modes are
# compared (they must be equal).  The prefix cache is off, so that both
# modes pay the same prefill.
#
#   scripts/bench-spec.sh [BUILD_DIR] [MODEL] [FILES...]
#   (defaults: build, ../shared/models/pycode/pycode-target-f16.gguf, three
#   files of the machine's Python 3 library)
# Env: LINES_PER_PROMPT (40), MAX_TOKENS (128), THREADS (1), SPEC_TOKENS (4).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
MODEL=${2:-../shared/models/pycode/pycode-target-f16.gguf}
shift $(( $# > 2 ? 2 : $# ))
PY=$(ls -d /usr/lib/python3.* 2>/dev/null | head -1)
FILES=("$@")
[ ${#FILES[@]} -gt 0 ] || FILES=("$PY/textwrap.py" "$PY/shlex.py" "$PY/json/encoder.py")
LINES=${LINES_PER_PROMPT:-40}
MAXT=${MAX_TOKENS:-128}
RUN=$(mktemp -d /tmp/bench-spec-XXXXXX)
trap '"$BUILD/router/llm-cluster" down --run-dir "$RUN" >/dev/null 2>&1 || true; rm -rf "$RUN"' EXIT
"$BUILD/router/llm-cluster" up --model "$MODEL" --pipelines 1 --stages 1 --device cpu \
    --threads "${THREADS:-1}" --port 0 --run-dir "$RUN" --insecure \
    --router-args "--spec off --spec-tokens ${SPEC_TOKENS:-4} --no-prefix-cache --metrics-listen 127.0.0.1:0" >/dev/null
. "$RUN/env.sh"
port=$(grep -o 'metrics on http://[^ ]* (port [0-9]*' "$RUN"/router*.log | grep -o '[0-9]*$' | head -1)
metric() { curl -s "http://127.0.0.1:$port/metrics" | awk -v m="$1" '$1 == m {print $2}'; }
now() { date +%s.%N; }
declare -A tot_t tot_n
for mode in off ngram; do tot_t[$mode]=0; tot_n[$mode]=0; done
d0=0; a0=0; v0=0
for f in "${FILES[@]}"; do
    prompt=$(head -n "$LINES" "$f")
    for mode in off ngram; do
        t0=$(now)
        out=$("$BUILD/clients/c/llm" generate --prompt "$prompt" --max-tokens "$MAXT" --no-stop-at-eos \
              --spec "$mode" --json --no-stream | tail -1)
        t1=$(now)
        n=$(echo "$out" | python3 -c 'import json,sys; print(len(json.load(sys.stdin)["ids"]))')
        echo "$out" | python3 -c 'import json,sys; print(json.load(sys.stdin)["ids"])' > "$RUN/ids-$mode"
        dt=$(echo "$t1 - $t0" | bc -l)
        tot_t[$mode]=$(echo "${tot_t[$mode]} + $dt" | bc -l)
        tot_n[$mode]=$((${tot_n[$mode]} + n))
        printf '%-28s %-6s %4d tokens %7.2f s %7.1f tokens/s\n' "$(basename "$f")" "$mode" "$n" "$dt" \
            "$(echo "$n / $dt" | bc -l)"
    done
    cmp -s "$RUN/ids-off" "$RUN/ids-ngram" || echo "  OUTPUTS DIFFER for $f"
    d=$(metric llm_spec_draft_tokens_total); a=$(metric llm_spec_accepted_tokens_total)
    v=$(metric llm_spec_verifications_total)
    printf '  drafts %d, accepted %d (%.0f%%), in %d verifications: %.2f tokens per verifying step\n' \
        "$(echo "$d - $d0" | bc)" "$(echo "$a - $a0" | bc)" "$(echo "100 * ($a - $a0) / ($d - $d0 + 0.0001)" | bc -l)" \
        "$(echo "$v - $v0" | bc)" "$(echo "1 + ($a - $a0) / ($v - $v0 + 0.0001)" | bc -l)"
    d0=$d; a0=$a; v0=$v
done
for mode in off ngram; do
    printf 'all %-6s %5d tokens %7.2f s %7.1f tokens/s\n' "$mode" "${tot_n[$mode]}" "${tot_t[$mode]}" \
        "$(echo "${tot_n[$mode]} / ${tot_t[$mode]}" | bc -l)"
done
