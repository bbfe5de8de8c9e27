// Checks bench/serve-bench.mjs against a mock OpenAI-compatible server that
// runs in this process: SSE streams with fixed delays (first token after
// TTFT_MS, then one every ITL_MS), usage on request, and prompts that make it
// fail in chosen ways.  The benchmark runs as a child process exactly as a
// user runs it; its --json output and the requests the mock saw are checked.
// Bounds on times are generous (a loaded 2-core CI machine), counts exact.
//
//   node serve_bench_check.mjs SCENARIO     (tests/bench/test_serve_bench.c runs each)

import { execFile } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import http from 'node:http';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { performance } from 'node:perf_hooks';

const here = path.dirname(fileURLToPath(import.meta.url));
const BENCH = path.resolve(here, '../../bench/serve-bench.mjs');
const TTFT_MS = 60;
const ITL_MS = 10;
const EOS_AT = 5; // without ignore_eos the mock "model" stops after this many tokens

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function fail(msg) {
  throw new Error(msg);
}
function check(cond, msg) {
  if (!cond) fail(msg);
}
function between(name, v, lo, hi) {
  check(v !== null && v >= lo && v <= hi, `${name} = ${v}, expected within [${lo}, ${hi}]`);
}

/* ---- the mock server ---------------------------------------------------- */

// opts: usage (send usage when asked, default true), perChunk (tokens per
// SSE chunk, default 1), apiKey (required when set).
function startMock(opts = {}) {
  const o = { usage: true, perChunk: 1, apiKey: null, ...opts };
  const seen = { requests: [], inflight: 0, maxInflight: 0 };
  const server = http.createServer((req, res) => {
    const t = performance.now(); // when the request's head was read
    const chunks = [];
    req.on('data', (c) => chunks.push(c));
    req.on('end', () => handle(req, res, Buffer.concat(chunks).toString('utf8'), t).catch((e) => {
      console.error('mock:', e);
      res.destroy();
    }));
  });
  const json = (res, status, obj) => {
    res.writeHead(status, { 'Content-Type': 'application/json' });
    res.end(JSON.stringify(obj));
  };
  async function handle(req, res, text, t) {
    if (o.apiKey && req.headers.authorization !== `Bearer ${o.apiKey}`)
      return json(res, 401, { error: { message: 'Incorrect API key provided', type: 'invalid_request_error' } });
    if (req.method === 'GET' && req.url === '/v1/models')
      return json(res, 200, { object: 'list', data: [{ id: 'mock-model', object: 'model' }] });
    const chat = req.url === '/v1/chat/completions';
    if (req.method !== 'POST' || (!chat && req.url !== '/v1/completions'))
      return json(res, 404, { error: { message: `no route ${req.method} ${req.url}` } });
    const body = JSON.parse(text);
    seen.requests.push({ url: req.url, body, t });
    const prompt = chat ? body.messages.map((m) => m.content).join('\n') : body.prompt;
    if (prompt.includes('FAIL503')) return json(res, 503, { error: { message: 'no pipeline serves the model' } });
    if (prompt.includes('FAIL429')) return json(res, 429, { error: { message: 'queue full' } });
    const n = body.ignore_eos ? body.max_tokens : Math.min(body.max_tokens, EOS_AT);
    const finish = body.ignore_eos || body.max_tokens <= EOS_AT ? 'length' : 'stop';
    seen.inflight++;
    seen.maxInflight = Math.max(seen.maxInflight, seen.inflight);
    res.writeHead(200, { 'Content-Type': 'text/event-stream', 'Cache-Control': 'no-cache' });
    const send = (obj) => res.write(`data: ${JSON.stringify(obj)}\n\n`);
    const base = { id: 'cmpl-1', object: chat ? 'chat.completion.chunk' : 'text_completion', model: body.model };
    const choice = (t, fin = null) =>
      chat ? { index: 0, delta: t === null ? { role: 'assistant', content: '' } : { content: t }, finish_reason: fin }
           : { index: 0, text: t ?? '', finish_reason: fin };
    try {
      // chat streams open with a role-only chunk that carries no text: not a token
      if (chat) send({ ...base, choices: [choice(null)] });
      await sleep(TTFT_MS);
      for (let i = 0; i < n; i += o.perChunk) {
        if (i > 0) await sleep(ITL_MS * o.perChunk);
        if (prompt.includes('STREAMERR') && i >= 2) {
          send({ error: { message: 'worker lost', type: 'server_error' } });
          break;
        }
        if (prompt.includes('CUT') && i >= 2) break;
        const k = Math.min(o.perChunk, n - i);
        // a ':' comment and a CRLF line ending now and then, which SSE allows
        if (i === 0) res.write(': keep-alive\n\n');
        res.write(`data: ${JSON.stringify({ ...base, choices: [choice(' tok'.repeat(k), i + k >= n ? finish : null)] })}\r\n\r\n`);
      }
      if (!prompt.includes('STREAMERR') && !prompt.includes('CUT')) {
        if (o.usage && body.stream_options?.include_usage)
          send({ ...base, choices: [], usage: { prompt_tokens: Array.isArray(prompt) ? prompt.length : prompt.split(' ').length,
                                                completion_tokens: n, total_tokens: n } });
        res.write('data: [DONE]\n\n');
      }
    } finally {
      seen.inflight--;
      res.end();
    }
  }
  return new Promise((resolve) => {
    server.listen(0, '127.0.0.1', () => {
      const url = `http://127.0.0.1:${server.address().port}`;
      resolve({ url, seen, close: () => new Promise((r) => { server.closeAllConnections(); server.close(r); }) });
    });
  });
}

/* ---- running the benchmark ---------------------------------------------- */

const tmp = mkdtempSync(path.join(tmpdir(), 'serve-bench-test-'));
process.on('exit', () => rmSync(tmp, { recursive: true, force: true }));

// Runs serve-bench with args; returns { code, stdout, stderr, json }.
function bench(args) {
  const jsonPath = path.join(tmp, `out-${Math.random().toString(36).slice(2)}.json`);
  return new Promise((resolve) => {
    execFile(process.execPath, [BENCH, ...args, '--json', jsonPath], { timeout: 60000 }, (err, stdout, stderr) => {
      let json = null;
      try {
        json = JSON.parse(readFileSync(jsonPath, 'utf8'));
      } catch {}
      const code = err ? (typeof err.code === 'number' ? err.code : -1) : 0;
      resolve({ code, stdout, stderr, json });
    });
  });
}

function describe(r) {
  return `exit ${r.code}\n--- stdout\n${r.stdout}\n--- stderr\n${r.stderr}`;
}

/* ---- scenarios ---------------------------------------------------------- */

const scenarios = {
  // The SSE parser alone: events split anywhere, CRLF and CR line ends,
  // comments, multi-line data.
  async sse_parser() {
    const { SseParser } = await import(BENCH);
    const text = 'data: {"a":1}\r\n\r\n: comment\n\ndata: x\ndata: y\n\nevent: e\rdata:z\r\rdata: [DONE]\n\n';
    for (let cut = 1; cut < 8; cut++) {
      const got = [];
      const p = new SseParser((d) => got.push(d));
      for (let i = 0; i < text.length; i += cut) p.push(text.slice(i, i + cut));
      p.end();
      check(JSON.stringify(got) === JSON.stringify(['{"a":1}', 'x\ny', 'z', '[DONE]']),
            `pieces of ${cut}: events ${JSON.stringify(got)}`);
    }
  },

  // Closed loop against /v1/completions with usage: exact token counts from
  // usage, every request to max_tokens, latencies near the mock's delays.
  async completions_concurrency() {
    const m = await startMock();
    try {
      const r = await bench(['--url', m.url, '--model', 'mock-model', '--concurrency', '4', '--requests', '12',
                             '--output-len', '8', '--input-len', '16', '--ignore-eos']);
      check(r.code === 0 && r.json, `serve-bench failed: ${describe(r)}`);
      const s = r.json;
      check(s.requests.total === 12 && s.requests.ok === 12, `requests ${JSON.stringify(s.requests)}`);
      check(m.seen.requests.length === 12, `the mock saw ${m.seen.requests.length} requests`);
      for (const { url, body } of m.seen.requests) {
        check(url === '/v1/completions', `request to ${url}`);
        check(body.max_tokens === 8 && body.ignore_eos === true && body.stream === true, `body ${JSON.stringify(body)}`);
        check(body.stream_options?.include_usage === true, 'stream_options.include_usage not sent');
        check(body.prompt.split(' ').length === 16, `prompt of ${body.prompt.split(' ').length} words, expected 16`);
      }
      between('the most requests in flight at the mock', m.seen.maxInflight, 2, 4);
      check(s.token_count_source === 'usage', `token_count_source ${s.token_count_source}`);
      check(s.output_tokens === 96 && s.output_chunks === 96, `output tokens ${s.output_tokens}, chunks ${s.output_chunks}`);
      check(s.prompt_tokens === 12 * 16, `prompt tokens ${s.prompt_tokens}`);
      check(s.finish_reasons.length === 12 && s.short_of_max_tokens === 0, `finish ${JSON.stringify(s.finish_reasons)}`);
      between('ttft p50', s.ttft_ms.p50, TTFT_MS * 0.8, 3000);
      between('ttft min', s.ttft_ms.min, TTFT_MS * 0.8, 3000);
      between('itl p50', s.itl_ms.p50, ITL_MS * 0.5, 1000);
      check(s.itl_ms.n === 12 * 7, `itl samples ${s.itl_ms.n}`);
      between('tpot p50', s.tpot_ms.p50, ITL_MS * 0.5, 1000);
      between('e2e min', s.e2e_ms.min, TTFT_MS + 7 * ITL_MS * 0.8, 5000);
      check(s.ttft_ms.p50 <= s.ttft_ms.p90 && s.ttft_ms.p90 <= s.ttft_ms.p99 && s.ttft_ms.p99 <= s.ttft_ms.max,
            `ttft percentiles out of order: ${JSON.stringify(s.ttft_ms)}`);
      between('output tok/s', s.output_throughput, 96 / 20, 96 / ((TTFT_MS + 7 * ITL_MS) * 3 / 1000) * 1.5);
      check(Math.abs(s.request_throughput - 12 / s.duration_s) < 1e-9, 'req/s is not ok requests / duration');
      for (const word of ['TTFT', 'TPOT', 'ITL', 'E2E', 'req/s', 'output tok/s', 'counted from the usage object'])
        check(r.stdout.includes(word), `the table lacks "${word}":\n${r.stdout}`);
    } finally {
      await m.close();
    }
  },

  // Chat without usage from the server: tokens counted as chunks (the
  // role-only first chunk is not one), stops before max_tokens without
  // ignore_eos, lengths drawn from a range.
  async chat_chunks() {
    const m = await startMock({ usage: false });
    try {
      const r = await bench(['--url', m.url + '/v1', '--model', 'mock-model', '--endpoint', 'chat', '--concurrency', '2',
                             '--requests', '10', '--output-len', '3:9', '--seed', '7']);
      check(r.code === 0 && r.json, `serve-bench failed: ${describe(r)}`);
      const s = r.json;
      check(s.requests.ok === 10, `requests ${JSON.stringify(s.requests)}`);
      const maxes = m.seen.requests.map(({ body }) => body.max_tokens);
      check(maxes.every((x) => x >= 3 && x <= 9), `max_tokens ${maxes} outside 3:9`);
      check(new Set(maxes).size > 1, `max_tokens ${maxes}: not drawn`);
      check(m.seen.requests.every(({ url, body }) => url === '/v1/chat/completions' && body.messages?.[0]?.role === 'user'
                                  && body.ignore_eos === undefined), 'chat body');
      const want = maxes.reduce((a, x) => a + Math.min(x, EOS_AT), 0);
      check(s.token_count_source === 'chunks', `token_count_source ${s.token_count_source}`);
      check(s.output_tokens === want, `output tokens ${s.output_tokens}, the mock sent ${want}`);
      check(s.prompt_tokens === null, 'prompt tokens without usage');
      const stops = maxes.filter((x) => x > EOS_AT).length;
      check((s.finish_reasons.stop ?? 0) === stops && (s.finish_reasons.length ?? 0) === 10 - stops,
            `finish ${JSON.stringify(s.finish_reasons)}, expected ${stops} stop`);
      check(s.short_of_max_tokens === stops, `short ${s.short_of_max_tokens}`);
      check(r.stdout.includes('counted from streamed chunks'), `the table does not say chunks:\n${r.stdout}`);
      // the same seed gives the same load
      const m2 = await startMock({ usage: false });
      try {
        await bench(['--url', m2.url, '--model', 'x', '--endpoint', 'chat', '--requests', '10', '--output-len', '3:9', '--seed', '7']);
        const again = m2.seen.requests.map(({ body }) => body.max_tokens);
        // the lanes interleave differently at another concurrency: compare as multisets
        check(JSON.stringify(again.slice().sort()) === JSON.stringify(maxes.slice().sort()),
              `seed 7 drew ${again} then ${maxes}`);
      } finally {
        await m2.close();
      }
    } finally {
      await m.close();
    }
  },

  // Several tokens per chunk with usage: tokens from usage, ITL between chunks.
  async batched_chunks() {
    const m = await startMock({ perChunk: 2 });
    try {
      const r = await bench(['--url', m.url, '--model', 'm', '--requests', '3', '--output-len', '6', '--ignore-eos']);
      check(r.code === 0 && r.json, `serve-bench failed: ${describe(r)}`);
      const s = r.json;
      check(s.output_tokens === 18 && s.output_chunks === 9, `tokens ${s.output_tokens} chunks ${s.output_chunks}`);
      check(r.stdout.includes('18 tokens came in 9 chunks'), `the table does not explain ITL:\n${r.stdout}`);
    } finally {
      await m.close();
    }
  },

  // Open loop: Poisson arrivals for a number of requests and for a duration;
  // closed loop for a duration.
  async poisson_and_duration() {
    const m = await startMock();
    try {
      let r = await bench(['--url', m.url, '--model', 'm', '--rate', '40', '--requests', '20', '--output-len', '4', '--ignore-eos']);
      check(r.code === 0 && r.json, `serve-bench failed: ${describe(r)}`);
      check(r.json.requests.ok === 20 && m.seen.requests.length === 20, `rate: ${JSON.stringify(r.json.requests)}`);
      check(r.json.load.mode === 'poisson' && r.json.load.rate === 40, `load ${JSON.stringify(r.json.load)}`);
      // 20 exponential gaps of mean 25 ms: about 0.5 s, and the last request's 90 ms
      between('poisson duration', r.json.duration_s, 0.1, 15);
      check(r.stdout.includes('Poisson arrivals at 40 req/s'), r.stdout);

      const before = m.seen.requests.length;
      m.seen.maxInflight = 0;
      r = await bench(['--url', m.url, '--model', 'm', '--rate', '100', '--duration', '0.4', '--concurrency', '3',
                       '--output-len', '4', '--ignore-eos']);
      check(r.code === 0 && r.json, `serve-bench failed: ${describe(r)}`);
      const n = m.seen.requests.length - before;
      check(r.json.requests.total === n, `report ${r.json.requests.total}, mock ${n}`);
      between('requests sent at 100/s for 0.4 s, 3 at most in flight', n, 3, 80);
      check(m.seen.maxInflight <= 3, `${m.seen.maxInflight} in flight, --concurrency 3`);

      const before2 = m.seen.requests.length;
      r = await bench(['--url', m.url, '--model', 'm', '--concurrency', '2', '--duration', '0.5', '--output-len', '4', '--ignore-eos']);
      check(r.code === 0 && r.json, `serve-bench failed: ${describe(r)}`);
      const n2 = m.seen.requests.length - before2;
      check(r.json.requests.total === n2 && r.json.requests.ok === n2, `duration: report ${r.json.requests.total}, mock ${n2}`);
      // each request takes >= 90 ms, so 2 lanes fit at most ~12 into 0.5 s
      between('requests in 0.5 s at concurrency 2', n2, 2, 14);
      between('duration of a 0.5 s run', r.json.duration_s, 0.5, 15);
    } finally {
      await m.close();
    }
  },

  // Prompts from a JSONL file, some of which fail: errors counted by kind,
  // the rest measured; per-line max_tokens.
  async errors_by_status() {
    const m = await startMock();
    const file = path.join(tmp, 'prompts.jsonl');
    writeFileSync(file, [
      { prompt: 'a fine prompt', max_tokens: 3 },
      { prompt: 'FAIL503 please' },
      { prompt: 'FAIL429 please' },
      { prompt: 'STREAMERR please' },
      { prompt: 'CUT please' },
    ].map((x) => JSON.stringify(x)).join('\n') + '\n\n');
    try {
      const r = await bench(['--url', m.url, '--model', 'm', '--prompts', file, '--requests', '10', '--concurrency', '3',
                             '--output-len', '6', '--ignore-eos']);
      check(r.code === 0 && r.json, `serve-bench failed: ${describe(r)}`);
      const s = r.json;
      const want = { 'HTTP 503': 2, 'HTTP 429': 2, 'stream: error event': 2, 'stream: ended before [DONE]': 2 };
      check(JSON.stringify(Object.entries(s.errors).sort()) === JSON.stringify(Object.entries(want).sort()),
            `errors ${JSON.stringify(s.errors)}, expected ${JSON.stringify(want)}`);
      check(s.requests.ok === 2 && s.requests.failed === 8, `requests ${JSON.stringify(s.requests)}`);
      check(s.output_tokens === 6, `output tokens ${s.output_tokens} (2 requests of max_tokens 3)`);
      check(s.error_examples['HTTP 503'] === 'no pipeline serves the model', `example ${JSON.stringify(s.error_examples)}`);
      check(s.error_examples['stream: error event'] === 'worker lost', `example ${JSON.stringify(s.error_examples)}`);
      check(/2 {2}HTTP 429: queue full/.test(r.stdout), `the table lacks the 429 line:\n${r.stdout}`);
      const prompts = m.seen.requests.map(({ body }) => body.prompt);
      check(prompts.filter((p) => p === 'a fine prompt').length === 2, `prompts sent: ${prompts}`);
    } finally {
      await m.close();
    }
  },

  // Token-id prompts of exact lengths below the vocabulary, and a warm-up
  // sent at the load's concurrency.
  async token_prompts_and_warmup() {
    const m = await startMock();
    try {
      const r = await bench(['--url', m.url, '--model', 'm', '--token-prompts', '1000', '--input-len', '20',
                             '--requests', '2', '--concurrency', '4', '--warmup', '4', '--output-len', '2', '--ignore-eos']);
      check(r.code === 0 && r.json, `serve-bench failed: ${describe(r)}`);
      check(m.seen.requests.length === 6, `the mock saw ${m.seen.requests.length} requests, expected 4 warm-up + 2`);
      const seen = new Set();
      for (const { body } of m.seen.requests) {
        const p = body.prompt;
        check(Array.isArray(p) && p.length === 20 && p.every((t) => Number.isInteger(t) && t >= 300 && t < 1000),
              `prompt ${JSON.stringify(p)}: expected 20 token ids in [300, 1000)`);
        seen.add(JSON.stringify(p));
      }
      check(seen.size === 6, `${seen.size} distinct prompts of 6`);
      check(r.json.prompt_tokens === 2 * 20, `prompt tokens ${r.json.prompt_tokens}`);
      // 2 measured requests cannot have more than 2 in flight: the rest is the warm-up's
      between('the most requests in flight at the mock', m.seen.maxInflight, 3, 4);
    } finally {
      await m.close();
    }
    const cases = [
      [['--endpoint', 'chat'], '--token-prompts: token-id prompts go to --endpoint completions only'],
      [['--prompt', 'hi'], '--token-prompts makes synthetic prompts: it excludes --prompts and --prompt'],
    ];
    for (const [args, want] of cases) {
      const r = await bench(['--url', 'http://x', '--model', 'm', '--token-prompts', '512', ...args]);
      check(r.code === 2 && r.stderr.includes(want), `serve-bench ${args.join(' ')}: expected exit 2 and "${want}", got ${describe(r)}`);
    }
    const r = await bench(['--url', 'http://x', '--model', 'm', '--token-prompts', '1']);
    check(r.code === 2 && r.stderr.includes('--token-prompts 1: a vocabulary of at least 2 tokens'), describe(r));
  },

  // --workers 3: the requests read on three client threads, the schedule,
  // the draws and the cap kept in one.  Every request counted once, the cap
  // global (not per thread), tokens and TTFT measured; the open loop sends
  // the same bodies at the same arrival times as one thread does.
  async workers() {
    const m = await startMock();
    try {
      const r = await bench(['--url', m.url, '--model', 'm', '--workers', '3', '--concurrency', '4', '--requests', '20',
                             '--warmup', '4', '--token-prompts', '1000', '--input-len', '8', '--output-len', '4',
                             '--ignore-eos']);
      check(r.code === 0 && r.json, `serve-bench failed: ${describe(r)}`);
      const s = r.json;
      check(s.workers === 3, `workers ${s.workers}`);
      check(m.seen.requests.length === 24, `the mock saw ${m.seen.requests.length} requests, expected 4 warm-up + 20`);
      check(s.requests.total === 20 && s.requests.ok === 20, `requests ${JSON.stringify(s.requests)}`);
      const measured = new Set(m.seen.requests.slice(4).map(({ body }) => JSON.stringify(body.prompt)));
      check(measured.size === 20, `${measured.size} distinct measured prompts of 20`);
      const per = s.requests_per_worker;
      check(Array.isArray(per) && per.length === 3 && per.every((n) => n > 0) && per.reduce((a, b) => a + b, 0) === 20,
            `requests_per_worker ${JSON.stringify(per)}: expected 3 threads sharing 20`);
      check(m.seen.maxInflight <= 4, `${m.seen.maxInflight} in flight at the mock, --concurrency 4`);
      between('the most requests in flight at the mock', m.seen.maxInflight, 3, 4);
      check(s.output_tokens === 80 && s.token_count_source === 'usage', `output tokens ${s.output_tokens} from ${s.token_count_source}`);
      check(s.ttft_ms.n === 20 && s.itl_ms.n === 20 * 3, `ttft n ${s.ttft_ms.n}, itl n ${s.itl_ms.n}`);
      between('ttft p50', s.ttft_ms.p50, TTFT_MS * 0.8, 3000);
      between('e2e min', s.e2e_ms.min, TTFT_MS + 3 * ITL_MS * 0.8, 5000);
      check(r.stdout.includes('20 requests from 3 client threads'), `the table does not name the threads:\n${r.stdout}`);

      // open loop, arrivals faster than the cap lets through
      const before = m.seen.requests.length;
      m.seen.maxInflight = 0;
      const c = await bench(['--url', m.url, '--model', 'm', '--workers', '3', '--rate', '200', '--concurrency', '3',
                             '--requests', '24', '--output-len', '3', '--ignore-eos']);
      check(c.code === 0 && c.json?.requests.ok === 24, `capped open loop: ${describe(c)}`);
      check(m.seen.requests.length - before === 24, `the mock saw ${m.seen.requests.length - before} requests, expected 24`);
      check(m.seen.maxInflight <= 3, `${m.seen.maxInflight} in flight at the mock, --concurrency 3`);
      check(c.json.requests_per_worker.reduce((a, b) => a + b, 0) === 24, `requests_per_worker ${c.json.requests_per_worker}`);
    } finally {
      await m.close();
    }

    // The open loop's schedule: each prompt (drawn in arrival order) reaches
    // the mock at the same offset with 3 threads as with 1, up to the timer
    // noise of a loaded machine.  Arrivals are 50 ms apart on average over
    // about 1.2 s.  The check once saw a spread of 51 ms where a few were
    // expected; what made the noise, and what the check does about it:
    // - the first arrivals of a run paid a connect and a thread's start-up
    //   (40-70 ms late with --workers 3): --warmup opens each thread's
    //   connections and runs its code before the clock starts;
    // - on a busy machine an arrival is now and then tens of ms late (an
    //   event loop not scheduled): the offsets are compared about their
    //   median, and a quarter of them may stray by more than 20 ms;
    // - with both cores of a 2-core machine kept busy and other clusters
    //   running, a run at times stalls for 100-300 ms and every arrival in
    //   that window is late by up to that much, which no bound that still
    //   means something absorbs: such a run is made again, and the check
    //   passes when some run with 1 thread and some run with 3 (of up to
    //   three each) agree.  Late arrivals are noise; a wrong schedule is
    //   wrong in every run.
    // A schedule drawn or kept per thread strays by hundreds of ms in every
    // pairing, and a rate off by a sixth (or a tenth) leaves 4 (7) of the 24
    // offsets within 20 ms of their median where 18 are needed.
    const N = 24, WARMUP = 6, NEAR_MS = 20, NEED = N * 3 / 4;
    const arrivals = async (workers) => {
      const mk = await startMock();
      try {
        const a = await bench(['--url', mk.url, '--model', 'm', '--workers', String(workers), '--rate', '20',
                               '--concurrency', '16', '--requests', String(N), '--warmup', String(WARMUP), '--seed', '5',
                               '--token-prompts', '1000', '--input-len', '4', '--output-len', '2', '--ignore-eos']);
        check(a.code === 0 && a.json?.requests.ok === N, `open loop, --workers ${workers}: ${describe(a)}`);
        check(mk.seen.requests.length === WARMUP + N, `the mock saw ${mk.seen.requests.length} requests with ` +
                                                      `--workers ${workers}, expected ${WARMUP} warm-up + ${N}`);
        const measured = mk.seen.requests.slice(WARMUP); // the warm-up ends before the clock starts
        const t0 = measured[0].t;
        const m = new Map(measured.map(({ body, t }) => [JSON.stringify(body.prompt), t - t0]));
        check(m.size === N, `${m.size} distinct prompts of ${N} with --workers ${workers}`);
        return m;
      } finally {
        await mk.close();
      }
    };
    const compare = (one, three) => {
      const diffs = [];
      for (const [p, t] of one) {
        check(three.has(p), `prompt ${p} sent with --workers 1, not with --workers 3`);
        diffs.push(three.get(p) - t);
      }
      const sorted = [...diffs].sort((x, y) => x - y);
      const median = (sorted[N / 2 - 1] + sorted[N / 2]) / 2;
      const near = diffs.filter((d) => Math.abs(d - median) <= NEAR_MS).length;
      return { diffs, median, near,
               text: `arrival offsets with --workers 3 minus those with 1: ${diffs.map((d) => d.toFixed(1))} ms; ` +
                     `${near} of ${N} within ${NEAR_MS} ms of their median ${median.toFixed(1)} ms, at least ${NEED} expected` };
    };
    const ones = [], threes = [];
    let best = null;
    for (let round = 1; round <= 3 && !(best?.near >= NEED); round++) {
      if (best) console.log(`workers: no pairing of the runs so far agrees, running both again; the best: ${best.text}`);
      ones.push(await arrivals(1));
      threes.push(await arrivals(3));
      for (const one of ones)
        for (const three of threes) {
          const c = compare(one, three);
          if (!best || c.near > best.near) best = c;
        }
    }
    check(best.near >= NEED, `in the best of ${ones.length} x ${threes.length} pairings of runs: ${best.text}`);
    const span = Math.max(...ones[0].values());
    between('the open loop\'s span of arrivals (ms)', span, 300, 5000);
  },

  // API keys and the model taken from /v1/models.
  async api_key_and_model() {
    const m = await startMock({ apiKey: 'sk-mock' });
    try {
      let r = await bench(['--url', m.url, '--model', 'm', '--requests', '2', '--output-len', '2']);
      check(r.code === 1 && r.json?.errors?.['HTTP 401'] === 2, `without a key: ${describe(r)}`);
      check(r.stdout.includes('Incorrect API key provided'), r.stdout);
      r = await bench(['--url', m.url, '--requests', '2', '--output-len', '2']);
      check(r.code === 2 && r.stderr.includes('GET ' + m.url + '/v1/models: HTTP 401'), `model lookup without a key: ${describe(r)}`);
      r = await bench(['--url', m.url, '--api-key', 'sk-mock', '--requests', '2', '--output-len', '2']);
      check(r.code === 0 && r.json.requests.ok === 2 && r.json.model === 'mock-model', `with the key: ${describe(r)}`);
      check(m.seen.requests.slice(-2).every(({ body }) => body.model === 'mock-model'), 'model not taken from /v1/models');
    } finally {
      await m.close();
    }
  },

  // Bad arguments and an unreachable server: clear messages, no traffic.
  async bad_input() {
    const bad = path.join(tmp, 'bad.jsonl');
    writeFileSync(bad, '{"prompt": "ok"}\n{"prompt": 3}\n');
    const msgs = path.join(tmp, 'msgs.jsonl');
    writeFileSync(msgs, '{"messages": [{"role": "user", "content": "hi"}]}\n');
    const cases = [
      [['--url', 'http://x', '--bogus'], 'unknown argument "--bogus"'],
      [['--model', 'm'], '--url is required'],
      [['--url', 'x:1'], '--url x:1: expected http://'],
      [['--url', 'http://x', '--endpoint', 'embeddings'], '--endpoint embeddings: expected completions or chat'],
      [['--url', 'http://x', '--concurrency', 'four'], '--concurrency four: not a whole number'],
      [['--url', 'http://x', '--output-len', '9:3'], '--output-len 9:3: the range ends below its start'],
      [['--url', 'http://x', '--rate', '0'], '--rate 0: must be above 0'],
      [['--url', 'http://x', '--requests', '5', '--duration', '2'], '--requests and --duration exclude each other'],
      [['--url', 'http://x', '--extra', '[1]'], '--extra [1]: must be a JSON object'],
      [['--url', 'http://x', '--workers', '0'], '--workers 0: must be between 1 and 64'],
      [['--url', 'http://x', '--workers', '65'], '--workers 65: must be between 1 and 64'],
      [['--url', 'http://x', '--workers', '-2'], '--workers -2: not a whole number'],
      [['--url', 'http://x', '--workers', '1.5'], '--workers 1.5: not a whole number'],
      [['--url', 'http://x', '--model', 'm', '--prompts', bad], `${bad} line 2: needs "prompt"`],
      [['--url', 'http://x', '--model', 'm', '--prompts', msgs], 'cannot send (use --endpoint chat)'],
      [['--url', 'http://x', '--model', 'm', '--prompts', '/nonexistent.jsonl'], '--prompts /nonexistent.jsonl: ENOENT'],
    ];
    for (const [args, want] of cases) {
      const r = await bench(args);
      check(r.code === 2 && r.stderr.includes(want), `serve-bench ${args.join(' ')}: expected exit 2 and "${want}", got ${describe(r)}`);
    }
    // nothing listens on a port just closed
    const s = http.createServer();
    await new Promise((r) => s.listen(0, '127.0.0.1', r));
    const port = s.address().port;
    await new Promise((r) => s.close(r));
    const r = await bench(['--url', `http://127.0.0.1:${port}`, '--model', 'm', '--requests', '3']);
    check(r.code === 1 && r.json?.errors?.['network: ECONNREFUSED'] === 3, `unreachable server: ${describe(r)}`);
    const help = await bench(['--help']);
    check(help.code === 0 && help.stdout.includes('--ignore-eos'), `--help: ${describe(help)}`);
  },
};

const name = process.argv[2];
if (!scenarios[name]) {
  console.error(`usage: serve_bench_check.mjs {${Object.keys(scenarios).join('|')}}`);
  process.exit(2);
}
scenarios[name]().then(
  () => {
    console.log(`${name}: ok`);
    process.exit(0);
  },
  (e) => {
    console.error(`${name}: FAILED: ${e.message}`);
    process.exit(1);
  },
);
