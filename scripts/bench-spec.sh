#!/bin/bash
# One stream's speed with speculative decoding (docs/router.md,
# "Speculation"; docs/performance.md), greedy, on a local 1x1 cluster: each
# prompt is the head of a source file, run once per mode:
#   off         speculation off
#   ngram       prompt lookup in the router
#   draft       the draft model beside the last stage (llm-worker --draft-model)
#   prediction  the perfect-draft ceiling: off's greedy token ids given back
#               as the request's prediction (llm generate --prediction-ids;
#               docs/router.md, "Predicted outputs")
#   prediction-text  the same as text (--prediction): what a client sends;
#               its tokenization may differ from the ids the model made
#   prediction-fixed  the ceiling where greedy output depends on how many
#               rows a step has (the CUDA kernels: a step of k + 1 rows may
#               round differently from a step of one, so prediction's
#               output can leave off's): the prediction is replaced by the
#               output of the run it fed until a run's output equals its
#               prediction (every drafted token accepted), at most
#               FIX_ROUNDS runs; that run is reported.  It converges: a
#               step's rows are computed independently of each other, so
#               the step that rejected a position gives the same row there
#               when the next run drafts its output, and each run accepts
#               at least one position further than the one before
# Each run prints its tokens, seconds and tokens/s end to end, and decode
# tokens/s: the tokens after the first streamed chunk over the time from the
# first chunk to the last (llm generate --json's timing), which leaves out
# the prefill (as the client sees the chunks: a client that is not
# scheduled when its first chunk arrives reads several at once, which
# shortens decode_s; with few tokens a request, e.g. 16, that can make the
# figure absurd, so keep MAX_TOKENS at 128 or more).  Speculating modes add the router's llm_spec_* deltas: drafts,
# accepted, verifying steps and tokens per verifying step (1 + accepted /
# steps), and the worker's own view (llm_step_time_seconds): the steps it
# ran (wstep) and its mean time per step (ms/wstep: the forward pass,
# sampling and, in draft mode, the draft's passes); decode_s - wstep *
# ms/wstep is about what the router, Redis, the client and the links add.
# Every mode's token ids must equal off's, else the run fails (EXACT=0: a
# differing mode is reported with the first token where it leaves off's,
# for backends whose greedy output depends on a step's row count).  A one-token
# request puts each prompt in the router's prefix cache first, so that every
# mode starts from the same cached prompt (and the worker's steps of a run
# are its decode, but the first, which computes the prompt's last block).
#
#   scripts/bench-spec.sh [BUILD_DIR] [MODEL] [FILES...]
#   BUILD_DIR: default build.  MODEL: a GGUF file (default the pycode target,
#   ../shared/models/pycode/pycode-target-f16.gguf) or synth:SHAPE:TYPE, a
#   synthetic model llm-synth writes into the run folder (synth:llama2-7b:q4_k_m;
#   worker/synth.h).  FILES: default three of the machine's Python 3 library.
# Env: MODES (default "off ngram draft prediction", draft only where DRAFT is
#   set; off always runs first), DRAFT (a draft GGUF; default the pycode draft
#   when MODEL is a pycode file), DEVICE (cpu; auto: a GPU per worker where
#   there are GPUs), THREADS (1), SPEC_TOKENS (4), MAX_TOKENS (128),
#   LINES_PER_PROMPT (40), TIMEOUT_S (600: one request's bound), WORKER_ARGS
#   (more llm-worker arguments, e.g. --draft-min-prob 0.5), ROUTER_ARGS (more
#   llm-router arguments, e.g. --spec-adapt), RESULTS (also
#   write one line per run, key=value, to this file), KEEP (1: keep the run
#   folder: outputs, logs, the synthetic model), EXACT (1), FIX_ROUNDS (64).
# Needs bash, awk and the build's llm-cluster, llm and llm-synth (MODEL synth:);
# no python, curl or bc (a GPU host may have none).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
MODEL=${2:-../shared/models/pycode/pycode-target-f16.gguf}
shift $(( $# > 2 ? 2 : $# ))
FILES=("$@")
if [ ${#FILES[@]} -eq 0 ]; then
    PY=$(ls -d /usr/lib/python3.* 2>/dev/null | head -1)
    [ -n "$PY" ] || { echo "bench-spec: no /usr/lib/python3.*: name the prompt files" >&2; exit 2; }
    FILES=("$PY/textwrap.py" "$PY/shlex.py" "$PY/json/encoder.py")
fi
for f in "${FILES[@]}"; do [ -r "$f" ] || { echo "bench-spec: $f: not readable" >&2; exit 2; }; done
LINES=${LINES_PER_PROMPT:-40}
MAXT=${MAX_TOKENS:-128}
K=${SPEC_TOKENS:-4}
DEVICE=${DEVICE:-cpu}
TMO=${TIMEOUT_S:-600}
if [ -z "${DRAFT+x}" ]; then
    DRAFT=""
    case $MODEL in *pycode-target*) DRAFT=$(dirname "$MODEL")/pycode-draft-f16.gguf ;; esac
fi
MODES=${MODES:-off ngram ${DRAFT:+draft} prediction}
MODES="off $(echo "$MODES" | tr ' ' '\n' | awk '$0 != "off" && $0 != ""' | tr '\n' ' ')"
for m in $MODES; do
    case $m in
    off | ngram | prediction | prediction-text | prediction-fixed) ;;
    draft) [ -n "$DRAFT" ] && [ -r "$DRAFT" ] || { echo "bench-spec: mode draft needs DRAFT=FILE (got \"$DRAFT\")" >&2; exit 2; } ;;
    *) echo "bench-spec: unknown mode \"$m\" (off, ngram, draft, prediction, prediction-text, prediction-fixed)" >&2; exit 2 ;;
    esac
done
for b in router/llm-cluster clients/c/llm; do
    [ -x "$BUILD/$b" ] || { echo "bench-spec: $BUILD/$b is not built" >&2; exit 2; }
done
RUN=$(mktemp -d /tmp/bench-spec-XXXXXX)
trap '"$BUILD/router/llm-cluster" down --run-dir "$RUN" >/dev/null 2>&1 || true; [ -n "${KEEP:-}" ] && echo "bench-spec: kept $RUN" || rm -rf "$RUN"' EXIT
if [ "${MODEL#synth:}" != "$MODEL" ]; then
    IFS=: read -r _ shape type <<<"$MODEL"
    [ -x "$BUILD/worker/llm-synth" ] || { echo "bench-spec: $BUILD/worker/llm-synth is not built" >&2; exit 2; }
    t0=$(date +%s)
    "$BUILD/worker/llm-synth" --shape "$shape" --type "${type:-q4_k_m}" --out "$RUN/synth.gguf" >/dev/null
    echo "bench-spec: wrote synthetic $shape ${type:-q4_k_m} in $(( $(date +%s) - t0 )) s"
    MODEL=$RUN/synth.gguf
fi
[ -r "$MODEL" ] || { echo "bench-spec: model $MODEL: not readable" >&2; exit 2; }
wargs=${WORKER_ARGS:-}
case " $MODES " in *" draft "*) wargs="--draft-model $DRAFT $wargs" ;; esac
"$BUILD/router/llm-cluster" up --model "$MODEL" --pipelines 1 --stages 1 --device "$DEVICE" \
    --threads "${THREADS:-1}" --port 0 --run-dir "$RUN" --insecure ${wargs:+--worker-args "$wargs"} \
    --router-args "--spec off --spec-tokens $K --metrics-listen 127.0.0.1:0 ${ROUTER_ARGS:-}" >/dev/null
. "$RUN/env.sh"
port=$(grep -o 'metrics on http://[^ ]* (port [0-9]*' "$RUN"/router*.log | grep -o '[0-9]*$' | head -1)
wport=$(grep -o 'metrics on http://[^ ]* (port [0-9]*' "$RUN"/worker*.log | grep -o '[0-9]*$' | head -1)
[ -n "$port" ] && [ -n "$wport" ] || { echo "bench-spec: the router or the worker logged no metrics port" >&2; exit 1; }
# A series of the router's (or, with a second argument, the worker's)
# /metrics, summed over its labels, through bash's /dev/tcp (no curl).
metric() {
    local body
    exec 3<>"/dev/tcp/127.0.0.1/${2:-$port}"
    printf 'GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3
    body=$(cat <&3)
    exec 3<&-
    echo "$body" | awk -v m="$1" '$1 == m || index($1, m "{") == 1 {v += $2} END {print v + 0}'
}
# A number of llm --json's last line: jnum FILE KEY.
jnum() { tail -n 1 "$1" | grep -o "\"$2\":[-0-9.eE+]*" | head -1 | cut -d: -f2; }
jids() { tail -n 1 "$1" | grep -o '"ids":\[[^]]*\]' | head -1; }
echo "bench-spec: $(basename "$MODEL") on $DEVICE, 1x1, greedy, $MAXT tokens a request, k = $K, modes: $MODES"
[ -n "$DRAFT" ] && case " $MODES " in *" draft "*) echo "bench-spec: draft $(basename "$DRAFT")" ;; esac
printf '%-20s %-15s %6s %8s %9s %10s %7s %7s %6s %9s %5s %8s\n' file mode tokens e2e_s "tok/s" "decode/s" drafts accept steps \
    "tok/step" wstep "ms/wstep"
declare -A S_n S_t S_dn S_dt S_d S_a S_v S_wn
for m in $MODES; do S_n[$m]=0; S_t[$m]=0; S_dn[$m]=0; S_dt[$m]=0; S_d[$m]=0; S_a[$m]=0; S_v[$m]=0; S_wn[$m]=0; done
fail=0
i=0
for f in "${FILES[@]}"; do
    i=$((i + 1))
    head -n "$LINES" "$f" >"$RUN/prompt-$i"
    # The prompt's prefill once, into the router's prefix cache: every mode
    # then starts from the same cached prompt (its last block and first
    # token computed again), so the worker's steps of a run are its decode.
    timeout "$TMO" "$BUILD/clients/c/llm" generate --prompt "$(cat "$RUN/prompt-$i")" --max-tokens 1 --spec off \
        >/dev/null 2>"$RUN/err-$i-prefill" || { echo "bench-spec: $f: prefill failed:" >&2; cat "$RUN/err-$i-prefill" >&2; exit 1; }
    for m in $MODES; do
        round=1
        cp "$RUN/ids-$i" "$RUN/fix-$i" 2>/dev/null || true
        while :; do
            spec=$m
            extra=()
            if [ "$m" = prediction ]; then
                spec=default
                extra=(--prediction-ids "$RUN/ids-$i")
            elif [ "$m" = prediction-fixed ]; then
                spec=default
                extra=(--prediction-ids "$RUN/fix-$i")
            elif [ "$m" = prediction-text ]; then
                spec=default
                extra=(--prediction "$RUN/pred-$i")
            fi
            d0=$(metric llm_spec_draft_tokens_total); a0=$(metric llm_spec_accepted_tokens_total)
            v0=$(metric llm_spec_verifications_total)
            ws0=$(metric llm_step_time_seconds_sum "$wport"); wn0=$(metric llm_step_time_seconds_count "$wport")
            t0=$(date +%s.%N)
            if ! timeout "$TMO" "$BUILD/clients/c/llm" generate --prompt "$(cat "$RUN/prompt-$i")" --max-tokens "$MAXT" \
                --no-stop-at-eos --spec "$spec" --json ${extra[@]+"${extra[@]}"} >"$RUN/out-$i-$m" 2>"$RUN/err-$i-$m"; then
                echo "bench-spec: $f mode $m failed:" >&2
                cat "$RUN/err-$i-$m" >&2
                exit 1
            fi
            t1=$(date +%s.%N)
            d1=$(metric llm_spec_draft_tokens_total); a1=$(metric llm_spec_accepted_tokens_total)
            v1=$(metric llm_spec_verifications_total)
            ws1=$(metric llm_step_time_seconds_sum "$wport"); wn1=$(metric llm_step_time_seconds_count "$wport")
            ids=$(jids "$RUN/out-$i-$m")
            n=$(echo "$ids" | awk -F, '{print ($0 == "\"ids\":[]" ? 0 : NF)}')
            dn=$(jnum "$RUN/out-$i-$m" decode_tokens); ds=$(jnum "$RUN/out-$i-$m" decode_s)
            [ -n "$dn" ] && [ -n "$ds" ] || { echo "bench-spec: $f mode $m: no timing in llm --json" >&2; exit 1; }
            if [ "$m" = prediction-fixed ] && [ "$ids" != "$(cat "$RUN/fix-$i")" ]; then
                if [ "$round" -ge "${FIX_ROUNDS:-64}" ]; then
                    echo "  NOT FIXED: $f mode $m: run $round's output still differs from its prediction" >&2
                    fail=1
                else
                    echo "$ids" >"$RUN/fix-$i"
                    round=$((round + 1))
                    continue
                fi
            fi
            if [ "$m" = off ]; then
                # The greedy text: stdout is the streamed text, a newline, then
                # the JSON line.
                total=$(wc -c <"$RUN/out-$i-$m"); last=$(tail -n 1 "$RUN/out-$i-$m" | wc -c)
                head -c $((total - last - 1)) "$RUN/out-$i-$m" >"$RUN/pred-$i"
                echo "$ids" >"$RUN/ids-$i"
            elif [ "$ids" != "$(cat "$RUN/ids-$i")" ]; then
                at=$(awk -F, -v a="$ids" -v b="$(cat "$RUN/ids-$i")" 'BEGIN {
                    na = split(a, x, ","); nb = split(b, y, ","); for (k = 1; k <= na && k <= nb && x[k] == y[k]; k++);
                    print k - 1 }')
                if [ "${EXACT:-1}" = 1 ]; then
                    echo "  OUTPUTS DIFFER: $f mode $m against off, from token $at" >&2
                    fail=1
                else
                    echo "  outputs differ: $f mode $m against off, from token $at (EXACT=0)" >&2
                fi
            fi
            [ "$m" = prediction-fixed ] && [ "$ids" = "$(cat "$RUN/fix-$i")" ] &&
                echo "  $f mode $m: run $round's output equals its prediction" >&2
            line=$(awk -v f="$(basename "$f")" -v m="$m" -v n="$n" -v t0="$t0" -v t1="$t1" -v dn="$dn" -v ds="$ds" \
                -v d="$(awk -v a="$d1" -v b="$d0" 'BEGIN{print a-b}')" -v a="$(awk -v a="$a1" -v b="$a0" 'BEGIN{print a-b}')" \
                -v v="$(awk -v a="$v1" -v b="$v0" 'BEGIN{print a-b}')" -v ws="$(awk -v a="$ws1" -v b="$ws0" 'BEGIN{print a-b}')" \
                -v wn="$(awk -v a="$wn1" -v b="$wn0" 'BEGIN{print a-b}')" 'BEGIN {
                    t = t1 - t0
                    printf "%-20s %-15s %6d %8.2f %9.1f %10.1f %7d %7d %6d %9.2f %5d %8.2f|%d %.6f %d %.6f %d %d %d %.6f %d\n", f, m,
                        n, t, n / t, (ds > 0 ? dn / ds : 0), d, a, v, (v > 0 ? 1 + a / v : 1), wn, (wn > 0 ? 1000 * ws / wn : 0),
                        n, t, dn, ds, d, a, v, ws, wn }')
            echo "${line%%|*}"
            read -r n t dn ds d a v ws wn <<<"${line#*|}"
            [ -n "${RESULTS:-}" ] && echo "file=$(basename "$f") mode=$m tokens=$n e2e_s=$t decode_tokens=$dn decode_s=$ds drafts=$d accepted=$a verifications=$v stage_steps=$wn stage_s=$ws" >>"$RESULTS"
            S_n[$m]=$((S_n[$m] + n)); S_dn[$m]=$((S_dn[$m] + dn)); S_d[$m]=$((S_d[$m] + d)); S_a[$m]=$((S_a[$m] + a))
            S_v[$m]=$((S_v[$m] + v)); S_wn[$m]=$((S_wn[$m] + wn))
            S_t[$m]=$(awk -v a="${S_t[$m]}" -v b="$t" 'BEGIN{print a+b}'); S_dt[$m]=$(awk -v a="${S_dt[$m]}" -v b="$ds" 'BEGIN{print a+b}')
            break
        done
    done
done
echo
printf '%-15s %7s %9s %10s %9s %8s %9s %9s\n' mode tokens "tok/s" "decode/s" "x off" "accept%" "tok/step" "verify%"
base=$(awk -v n="${S_dn[off]}" -v t="${S_dt[off]}" 'BEGIN{print (t > 0 ? n / t : 0)}')
for m in $MODES; do
    awk -v m="$m" -v n="${S_n[$m]}" -v t="${S_t[$m]}" -v dn="${S_dn[$m]}" -v dt="${S_dt[$m]}" -v d="${S_d[$m]}" \
        -v a="${S_a[$m]}" -v v="${S_v[$m]}" -v wn="${S_wn[$m]}" -v nf="${#FILES[@]}" -v base="$base" 'BEGIN {
        r = dt > 0 ? dn / dt : 0
        # verify%: the decode steps that carried drafts, of the steps the
        # worker ran less the first of each run (the prompt tail)
        st = wn - nf
        printf "%-15s %7d %9.1f %10.1f %8.2fx %7.0f%% %9.2f %8.0f%%\n", m, n, (t > 0 ? n / t : 0), r,
            (base > 0 ? r / base : 0), (d > 0 ? 100 * a / d : 0), (v > 0 ? 1 + a / v : 1), (st > 0 ? 100 * v / st : 0) }'
done
[ -n "${RESULTS:-}" ] && for m in $MODES; do
    echo "total mode=$m tokens=${S_n[$m]} e2e_s=${S_t[$m]} decode_tokens=${S_dn[$m]} decode_s=${S_dt[$m]} drafts=${S_d[$m]} accepted=${S_a[$m]} verifications=${S_v[$m]}" >>"$RESULTS"
done
[ $fail -eq 0 ] || { echo "bench-spec: outputs differ between modes (see above)" >&2; exit 1; }
