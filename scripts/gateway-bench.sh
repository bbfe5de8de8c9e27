#!/bin/bash
# The gateway against libllmclient on the same model, device and load: first
# bench_cluster through libllmclient on a 1x1 cluster, then a 1x1 cluster with
# llm-gateway (llm-cluster up --http-port) loaded by bench/serve-bench.mjs,
# with prompts of exactly the same number of token ids (serve-bench
# --token-prompts with the vocabulary `llm models` reports), the same number
# generated (EOS ignored) and the same concurrency; serve-bench warms the
# gateway's router connections up at the load's concurrency before each run.
# Closed loop by default (each stream sends its next request when the last
# ends); with LLM_GW_BENCH_RATE both clients run open loop: Poisson arrivals
# at that rate with the level's concurrency as the most in flight, run r of
# each side drawing the same arrival times (bench_cluster --seed 0 gives its
# level r seed r, serve-bench run r takes --seed r).  TTFT p50 of a closed
# loop depends on how each client's arrivals line up with the scheduler's
# steps; the open loop gives both the same arrivals, so the difference is
# what the gateway and the HTTP client add (docs/gateway.md).
# Builds nothing: runs bench_cluster, llm-cluster, llm-router, llm-worker,
# llm-gateway, llm (and llm-synth without a model) of the build folder.
#   OUT=/tmp/out ./scripts/gateway-bench.sh                  # build-clbench, --device auto, 7B Q4_K_M
#   LLM_BENCH_DEVICE=cpu LLM_BENCH_THREADS=1 LLM_GW_BENCH_SHAPE=tiny LLM_GW_BENCH_TYPE=f32 \
#       LLM_BENCH_BUILD=build-gw LLM_GW_BENCH_CONC=1,8 LLM_GW_BENCH_REQUESTS=96 ./scripts/gateway-bench.sh
#   LLM_GW_BENCH_CONC=64 LLM_GW_BENCH_RATE=60 OUT=/tmp/out ./scripts/gateway-bench.sh   # open loop
# Settings: LLM_BENCH_BUILD (build folder), LLM_BENCH_DEVICE (auto or cpu),
# LLM_BENCH_THREADS (CPU threads per worker), LLM_GW_BENCH_MODEL (a model
# file; none: llm-synth writes LLM_GW_BENCH_SHAPE, default llama2-7b, in
# LLM_GW_BENCH_TYPE, default q4_k_m, and removes it at the end),
# LLM_GW_BENCH_CONC (concurrency levels, default 1,64), LLM_GW_BENCH_REQUESTS
# (per level and run; default 4 per stream and at least 32: 32 at
# concurrency 1, 256 at 64), LLM_GW_BENCH_PROMPT (prompt tokens, 128),
# LLM_GW_BENCH_GEN (tokens generated, 64), LLM_GW_BENCH_RUNS (gateway runs
# per level and side, each with its own prompts, default 3),
# LLM_GW_BENCH_RATE (requests/s, the same at every level; empty: closed loop),
# LLM_GW_BENCH_SB_WORKERS (serve-bench --workers of the measured runs: client
# threads reading the streams, default 1; one event loop reading 64 streams
# stamps their tokens late, docs/serve-bench.md).
# Under $OUT: bench_cluster-c<C>.{txt,json,log} (a warm-up row, then the
# runs), serve-c<C>-r<R>.{txt,json}, cluster-logs.tar.gz (the gateway
# cluster's run dir) and summary.txt, which is printed last: per level, each
# run's gen tok/s and TTFT, each gateway run against the mean of
# libllmclient's runs (TTFT p50 difference, throughput ratio), and the same
# for the means of the gateway's runs.
# Budget on one H200 with the 7B model at the defaults: about 3 minutes.
set -u
cd "$(dirname "$0")/.." || exit 2
out=${OUT:-/tmp/gateway-bench}
mkdir -p "$out"
build=${LLM_BENCH_BUILD:-build-clbench}
case $build in /*) ;; *) build=$PWD/$build ;; esac
device=${LLM_BENCH_DEVICE:-auto}
threads=${LLM_BENCH_THREADS:-0}
conc=${LLM_GW_BENCH_CONC:-1,64}
requests=${LLM_GW_BENCH_REQUESTS:-}
prompt=${LLM_GW_BENCH_PROMPT:-128}
gen=${LLM_GW_BENCH_GEN:-64}
runs=${LLM_GW_BENCH_RUNS:-3}
rate=${LLM_GW_BENCH_RATE:-}
sb_workers=${LLM_GW_BENCH_SB_WORKERS:-1}
if ! [[ $sb_workers =~ ^[1-9][0-9]?$ && $sb_workers -le 64 ]]; then
    echo "gateway-bench: LLM_GW_BENCH_SB_WORKERS=$sb_workers: expected serve-bench client threads, 1 to 64" >&2
    exit 2
fi
if [ -n "$rate" ] && ! [[ $rate =~ ^[0-9]*\.?[0-9]+$ && ! $rate =~ ^0*\.?0*$ ]]; then
    echo "gateway-bench: LLM_GW_BENCH_RATE=$rate: expected requests per second above 0 (or empty for the closed loop)" >&2
    exit 2
fi
# Both clients' open-loop flags: bench_cluster's level k draws from seed 0 + k.
cb_rate=()
sb_rate=()
if [ -n "$rate" ]; then
    cb_rate=(--rate "$rate" --seed 0)
    sb_rate=(--rate "$rate")
fi
export NCCL_NVLS_ENABLE=0
# shellcheck disable=SC1091
[ -f .deps/env.sh ] && . .deps/env.sh
[ -d "$build/rt" ] && export LD_LIBRARY_PATH="$build/rt${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
tmp=${TMPDIR:-/tmp}

for b in bench/bench_cluster router/llm-cluster router/llm-router clients/c/llm worker/llm-worker gateway/llm-gateway; do
    if [ ! -x "$build/$b" ]; then
        echo "gateway-bench: $build/$b is missing: build it first (cmake --build $build --target bench_cluster" \
            "llm-cluster llm-router llm-worker llm-gateway llm llm-synth)" >&2
        exit 2
    fi
done
if ! node -e 'process.exit(Number(process.versions.node.split(".")[0]) >= 18 ? 0 : 1)' 2>/dev/null; then
    echo "gateway-bench: serve-bench needs Node 18 or newer in PATH" >&2
    exit 2
fi

model=${LLM_GW_BENCH_MODEL:-}
written=""
if [ -z "$model" ]; then
    shape=${LLM_GW_BENCH_SHAPE:-llama2-7b}
    wtype=${LLM_GW_BENCH_TYPE:-q4_k_m}
    model=$tmp/gateway-bench-$shape-$wtype.gguf
    if [ ! -x "$build/worker/llm-synth" ]; then
        echo "gateway-bench: no LLM_GW_BENCH_MODEL and $build/worker/llm-synth is not built" >&2
        exit 2
    fi
    if ! timeout 180 "$build/worker/llm-synth" --out "$model" --shape "$shape" --type "$wtype" >"$out/synth.log" 2>&1; then
        echo "gateway-bench: llm-synth failed (see $out/synth.log)" >&2
        rm -f "$model"
        exit 1
    fi
    written=$model
fi
status=0

# Requests of a level.
level_requests() {
    if [ -n "$requests" ]; then
        echo "$requests"
    else
        echo $(($1 * 4 > 32 ? $1 * 4 : 32))
    fi
}

# libllmclient: bench_cluster on a 1x1 cluster of its own per level, the
# level run runs + 1 times on it with fresh prompts each time: the first
# warms the cluster up as serve-bench's --warmup does the gateway's, the
# others are the runs compared (its --requests is one number for all levels).
# Open loop: the warm-up level draws its arrivals from seed 0, run r from seed r.
for c in ${conc//,/ }; do
    echo "gateway-bench: bench_cluster (libllmclient) at concurrency $c${rate:+, $rate req/s}, $runs runs after a warm-up" >&2
    mkdir -p "$out/bench_cluster-runs"
    levels=$c
    for _ in $(seq 1 "$runs"); do levels=$levels,$c; done
    timeout --signal=TERM --kill-after=20 600 "$build/bench/bench_cluster" --model "$model" --device "$device" \
        --threads "$threads" --layouts 1x1 --concurrency "$levels" --requests "$(level_requests "$c")" \
        --prompt-tokens "$prompt" --max-tokens "$gen" "${cb_rate[@]}" --up-timeout-s 180 --tmpdir "$tmp" \
        --run-root "$out/bench_cluster-runs" --json "$out/bench_cluster-c$c.json" >"$out/bench_cluster-c$c.txt" \
        2>"$out/bench_cluster-c$c.log" || {
        echo "gateway-bench: bench_cluster at concurrency $c failed; log tail:" >&2
        tail -n 15 "$out/bench_cluster-c$c.log" >&2
        status=1
    }
    for d in "$out/bench_cluster-runs"/*/; do
        [ -d "$d" ] && "$build/router/llm-cluster" down --run-dir "$d" >/dev/null 2>&1
    done
    rm -rf "$out/bench_cluster-runs"
done

# The gateway: a 1x1 cluster with llm-gateway on a free port.
port=$(node -e 'const s=require("net").createServer().listen(0,"127.0.0.1",()=>{console.log(s.address().port);s.close()})')
run_dir=$tmp/gateway-bench-cluster
rm -rf "$run_dir"
echo "gateway-bench: llm-cluster up with llm-gateway on port $port" >&2
if ! "$build/router/llm-cluster" up --model "$model" --pipelines 1 --stages 1 --device "$device" --threads "$threads" \
    --port 0 --run-dir "$run_dir" --http-port "$port" --timeout-s 180 >"$out/cluster-up.log" 2>&1; then
    echo "gateway-bench: llm-cluster up failed; log tail:" >&2
    tail -n 15 "$out/cluster-up.log" >&2
    "$build/router/llm-cluster" down --run-dir "$run_dir" >/dev/null 2>&1
    [ -n "$written" ] && rm -f "$written"
    exit 1
fi
# shellcheck disable=SC1091
. "$run_dir/env.sh"
# The gateway's /metrics (its address from the run dir's file_sd targets),
# read before and after each measured run: llm_gateway_added_latency_seconds
# is the gateway's own share of each first token.
gw_scrape() {
    node -e '
const fs = require("fs"), http = require("http");
const t = JSON.parse(fs.readFileSync(process.argv[1], "utf8")).find((x) => x.labels.job === "llm-gateway");
if (!t) process.exit(0);
http.get(`http://${t.targets[0]}/metrics`, (res) => res.pipe(process.stdout)).on("error", () => process.exit(0));
' "$run_dir/prometheus-targets.json" 2>/dev/null
}
vocab=$("$build/clients/c/llm" models 2>/dev/null | sed -n 's/.*vocabulary \([0-9]*\).*/\1/p' | head -n 1)
if [ -z "$vocab" ]; then
    echo "gateway-bench: llm models gave no vocabulary size" >&2
    status=1
else
    for c in ${conc//,/ }; do
        for r in $(seq 1 "$runs"); do
            echo "gateway-bench: serve-bench at concurrency $c${rate:+, $rate req/s}, run $r of $runs" >&2
            # The warm-up (router connections open at this concurrency) as
            # a run of its own, so that the gateway's metrics read around
            # the measured run count its requests alone.
            timeout 600 node bench/serve-bench.mjs --url "$OPENAI_BASE_URL" --concurrency "$c" --requests "$c" \
                --token-prompts "$vocab" --input-len "$prompt" --output-len "$gen" --ignore-eos \
                --seed "$((1000 + r))" --quiet >/dev/null 2>&1 || status=1
            gw_scrape >"$out/gateway-metrics-c$c-r$r.before"
            timeout 600 node bench/serve-bench.mjs --url "$OPENAI_BASE_URL" --concurrency "$c" "${sb_rate[@]}" \
                --workers "$sb_workers" \
                --requests "$(level_requests "$c")" \
                --token-prompts "$vocab" --input-len "$prompt" --output-len "$gen" --ignore-eos \
                --seed "$r" --quiet --json "$out/serve-c$c-r$r.json" >"$out/serve-c$c-r$r.txt" 2>&1 || status=1
            gw_scrape >"$out/gateway-metrics-c$c-r$r.after"
        done
    done
fi
"$build/router/llm-cluster" down --run-dir "$run_dir" >/dev/null 2>&1
tar -czf "$out/cluster-logs.tar.gz" -C "$tmp" "$(basename "$run_dir")" 2>/dev/null && rm -rf "$run_dir"
[ -n "$written" ] && rm -f "$written"

# The comparison, from the JSON both wrote.
node - "$out" "$conc" "$runs" "$prompt" "$gen" "$device" "$rate" >"$out/summary.txt" <<'EOF'
const fs = require('fs');
const [outDir, concs, runs, prompt, gen, device, rate] = process.argv.slice(2);
const read = (f) => { try { return JSON.parse(fs.readFileSync(`${outDir}/${f}`, 'utf8')); } catch { return null; } };

const f = (v, d = 1) => (typeof v === 'number' && Number.isFinite(v) ? v.toFixed(d) : '-');
const mode = rate ? `open loop: Poisson arrivals at ${rate} req/s, at most conc in flight, the same arrival times for run r of both`
                  : 'closed loop: conc streams, each sending its next request when the last ends';
console.log(`## llm-gateway against libllmclient: 1x1, device ${device}, prompts of ${prompt} token ids, ${gen} generated, ${mode}`);
console.log('');
console.log('| conc | run | req/s | gen tok/s | TTFT p50 ms | TTFT p90 ms | ITL p50 ms | TTFT p50 - libllmclient ms | tok/s / libllmclient | gateway\'s own share ms, mean / p50 | errors |');
console.log('|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|');
const mean = (xs) => xs.reduce((a, b) => a + b, 0) / xs.length;
// llm_gateway_added_latency_seconds over one run: the difference of the
// scrapes around it; mean, and the median interpolated in its buckets.
const histo = (text) => {
  const h = { b: [], sum: 0, count: 0 };
  for (const line of (text ?? '').split('\n')) {
    let m = line.match(/^llm_gateway_added_latency_seconds_bucket\{le="([^"]+)"\} (\S+)/);
    if (m) h.b.push([m[1] === '+Inf' ? Infinity : Number(m[1]), Number(m[2])]);
    m = line.match(/^llm_gateway_added_latency_seconds_(sum|count) (\S+)/);
    if (m) h[m[1]] = Number(m[2]);
  }
  return h;
};
const added = (c, r) => {
  let before, after;
  try {
    before = histo(fs.readFileSync(`${outDir}/gateway-metrics-c${c}-r${r}.before`, 'utf8'));
    after = histo(fs.readFileSync(`${outDir}/gateway-metrics-c${c}-r${r}.after`, 'utf8'));
  } catch { return null; }
  const n = after.count - before.count;
  if (!(n > 0) || after.b.length !== before.b.length) return null;
  const cum = after.b.map(([le, v], i) => [le, v - before.b[i][1]]);
  let p50 = null, lo = 0, prev = 0;
  for (const [le, v] of cum) {
    if (v >= n / 2) { p50 = le === Infinity ? lo : lo + (le - lo) * (n / 2 - prev) / Math.max(v - prev, 1); break; }
    lo = le; prev = v;
  }
  return { mean: (after.sum - before.sum) / n * 1e3, p50: p50 === null ? null : p50 * 1e3, n };
};
for (const c of concs.split(',').map(Number)) {
  // The level's first row warmed the cluster up; the others are its runs.
  const rows = (read(`bench_cluster-c${c}.json`)?.rows ?? []).filter((x) => x.concurrency === c && x.ran).slice(1);
  // capped (open loop): arrivals that found every stream busy and waited for one.
  const capped = (row) => (typeof row.capped === 'number' && row.capped > 0 ? `; ${row.capped} capped, ${f(row.cap_wait_ms_mean, 2)} ms wait` : '');
  rows.forEach((row, i) => console.log(`| ${c} | libllmclient ${i + 1} | ${f(row.req_s, 2)} | ${f(row.tok_s)} | ${f(row.ttft_p50_ms, 2)} | ${f(row.ttft_p90_ms, 2)} | ${f(row.itl_p50_ms, 2)} | | | | ${row.failed}${capped(row)} |`));
  if (rows.length === 0) console.log(`| ${c} | libllmclient | - | - | - | - | - | | | | no row |`);
  const base = rows.length ? { ttft: mean(rows.map((x) => x.ttft_p50_ms)), tok: mean(rows.map((x) => x.tok_s)) } : null;
  // Open loop: run r of both sides had the same arrival times, so each
  // gateway run is compared with its own libllmclient run; closed loop:
  // with the mean of libllmclient's runs.
  const gw = [], ds = [], qs = [], owns = [];
  for (let r = 1; r <= Number(runs); r++) {
    const s = read(`serve-c${c}-r${r}.json`);
    if (!s) { console.log(`| ${c} | gateway ${r} | - | - | - | - | - | - | - | - | no result |`); continue; }
    gw.push(s);
    const ref = rate && rows[r - 1] ? { ttft: rows[r - 1].ttft_p50_ms, tok: rows[r - 1].tok_s } : base;
    const d = ref && s.ttft_ms.p50 !== null ? s.ttft_ms.p50 - ref.ttft : null;
    const q = ref && ref.tok > 0 ? s.output_throughput / ref.tok : null;
    const own = added(c, r);
    if (d !== null) ds.push(d);
    if (q !== null) qs.push(q);
    if (own) owns.push(own);
    console.log(`| ${c} | gateway ${r} | ${f(s.request_throughput, 2)} | ${f(s.output_throughput)} | ${f(s.ttft_ms.p50, 2)} | ${f(s.ttft_ms.p90, 2)} | ${f(s.itl_ms.p50, 2)} | ${d === null ? '-' : (d >= 0 ? '+' : '') + d.toFixed(2)} | ${f(q, 3)} | ${own ? `${f(own.mean, 3)} / ${f(own.p50, 3)}` : '-'} | ${s.requests.failed}${s.prompt_tokens !== null && s.prompt_tokens !== s.requests.ok * Number(prompt) ? ` (prompt tokens ${s.prompt_tokens})` : ''} |`);
  }
  if (ds.length) {
    const d = mean(ds), q = qs.length ? mean(qs) : null;
    const own = owns.length ? `${f(mean(owns.map((o) => o.mean)), 3)} / ${f(mean(owns.map((o) => o.p50 ?? NaN)), 3)}` : '';
    console.log(`| ${c} | mean of runs | | | | | | ${(d >= 0 ? '+' : '') + d.toFixed(2)} | ${f(q, 3)} | ${own} | |`);
  }
}
EOF
cat "$out/summary.txt"
exit $status
