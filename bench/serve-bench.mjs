#!/usr/bin/env node
// serve-bench: a serving benchmark over the OpenAI HTTP API.  It drives any
// OpenAI-compatible server (llm-gateway, llama.cpp's llama-server, vLLM) with
// streamed completions or chat completions at a fixed concurrency or with
// open-loop Poisson arrivals, and reports throughput and TTFT, TPOT,
// inter-token and end-to-end latency as a table and as JSON.
// Node 20 and nothing else: node:http with kept-alive connections, each
// streamed response read as it arrives.
// docs/serve-bench.md describes the flags, the numbers and their definitions.

import { readFileSync, realpathSync, writeFileSync } from 'node:fs';
import http from 'node:http';
import https from 'node:https';
import { performance } from 'node:perf_hooks';
import { pathToFileURL } from 'node:url';
import { isMainThread, parentPort, Worker, workerData } from 'node:worker_threads';

/* ---- options ------------------------------------------------------------ */

// One table drives the parser, the defaults and --help.  kind: "str", "int",
// "num" (a number), "range" (N or A:B, integers), "flag"; env names the
// environment variable that supplies the default where there is one.
const OPTIONS = [
  ['url', 'str', null, 'OPENAI_BASE_URL', 'server address: http://host:port (then /v1 is added) or .../v1'],
  ['model', 'str', null, null, 'model name; default: the first of GET /v1/models'],
  ['api-key', 'str', null, 'OPENAI_API_KEY', 'sent as Authorization: Bearer KEY'],
  ['endpoint', 'str', 'completions', null, 'completions (POST /v1/completions) or chat (POST /v1/chat/completions)'],
  ['concurrency', 'int', null, null, 'closed loop: N requests in flight at all times (default 1); with --rate, the most in flight'],
  ['rate', 'num', null, null, 'open loop: Poisson arrivals at R requests/s'],
  ['requests', 'int', null, null, 'how many requests to send (default 100 unless --duration)'],
  ['duration', 'num', null, null, 'send new requests for S seconds, then wait for those in flight'],
  ['input-len', 'range', '32', null, 'synthetic prompt length in words (in token ids with --token-prompts): N, or A:B drawn uniformly'],
  ['token-prompts', 'int', null, null, 'synthetic prompts as --input-len random token ids below VOCAB (the model\'s vocabulary size) instead of words: exact prompt lengths whatever the tokenizer (completions only)'],
  ['output-len', 'range', '128', null, 'max_tokens: N, or A:B drawn uniformly'],
  ['prompts', 'str', null, null, 'JSONL file, one {"prompt": ...} or {"messages": [...]} per line (optional "max_tokens"); used in turn'],
  ['prompt', 'str', null, null, 'one fixed prompt text for every request'],
  ['ignore-eos', 'flag', false, null, 'send "ignore_eos": true so that every request generates max_tokens (llama-server, vLLM, llm-gateway)'],
  ['no-usage', 'flag', false, null, 'do not send stream_options.include_usage (for servers that refuse it); tokens are then counted as chunks'],
  ['temperature', 'num', '0', null, 'sampling temperature'],
  ['extra', 'str', null, null, 'JSON object merged into every request body, e.g. \'{"top_k": 1}\''],
  ['seed', 'int', '1', null, 'seed of the prompt, length and arrival draws (the same seed gives the same load)'],
  ['workers', 'int', '1', null, 'client threads that send the requests and read their streams, each with its own connections and event loop; the schedule and the cap stay in one thread'],
  ['warmup', 'int', '0', null, 'requests sent before the measurement, not counted, up to --concurrency at a time'],
  ['timeout', 'num', '600', null, 'seconds one request may take before it counts as an error'],
  ['json', 'str', null, null, 'also write the results as JSON to FILE'],
  ['quiet', 'flag', false, null, 'no progress line on stderr'],
  ['help', 'flag', false, null, 'this text'],
];

class UsageError extends Error {}

// More client threads than this only add startup time: at 64 streams a
// thread each, no event loop has more than one stream to read.
const MAX_WORKERS = 64;

function usage() {
  const lines = ['usage: serve-bench.mjs --url URL [options]', ''];
  for (const [name, kind, def, env, help] of OPTIONS) {
    const arg = kind === 'flag' ? '' : kind === 'range' ? ' N|A:B' : kind === 'str' ? ' S' : ' N';
    let extra = def !== null && def !== false ? ` (default ${def})` : '';
    if (env) extra += ` [env ${env}]`;
    lines.push(`  --${name}${arg}`.padEnd(26) + help + extra);
  }
  return lines.join('\n');
}

function parseValue(name, kind, text) {
  if (kind === 'str') return text;
  if (kind === 'int') {
    if (!/^\d+$/.test(text)) throw new UsageError(`--${name} ${text}: not a whole number >= 0`);
    return Number(text);
  }
  if (kind === 'num') {
    const v = Number(text);
    if (text.trim() === '' || !Number.isFinite(v) || v < 0) throw new UsageError(`--${name} ${text}: not a number >= 0`);
    return v;
  }
  if (kind === 'range') {
    const m = /^(\d+)(?::(\d+))?$/.exec(text);
    if (!m) throw new UsageError(`--${name} ${text}: expected N or A:B (whole numbers)`);
    const lo = Number(m[1]);
    const hi = m[2] === undefined ? lo : Number(m[2]);
    if (hi < lo) throw new UsageError(`--${name} ${text}: the range ends below its start`);
    return { lo, hi };
  }
  throw new Error(`option kind ${kind}`);
}

export function parseArgs(argv, env = process.env) {
  const opt = {};
  const given = new Set();
  for (const [name, kind, def, envName] of OPTIONS) {
    const key = name.replace(/-(.)/g, (_, c) => c.toUpperCase());
    if (envName && env[envName]) opt[key] = parseValue(name, kind, env[envName]);
    else if (kind === 'flag') opt[key] = false;
    else opt[key] = def === null ? null : parseValue(name, kind, def);
  }
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    const eq = a.indexOf('=');
    const name = a.startsWith('--') ? a.slice(2, eq > 0 ? eq : undefined) : null;
    const spec = name && OPTIONS.find((o) => o[0] === name);
    if (!spec) throw new UsageError(`unknown argument "${a}" (--help lists the options)`);
    const key = name.replace(/-(.)/g, (_, c) => c.toUpperCase());
    given.add(name);
    if (spec[1] === 'flag') {
      if (eq > 0) throw new UsageError(`--${name} takes no value`);
      opt[key] = true;
      continue;
    }
    let text;
    if (eq > 0) text = a.slice(eq + 1);
    else if (i + 1 < argv.length) text = argv[++i];
    else throw new UsageError(`--${name} needs a value`);
    opt[key] = parseValue(name, spec[1], text);
  }
  if (opt.help) return opt;
  if (!opt.url) throw new UsageError('--url is required (or OPENAI_BASE_URL)');
  if (!/^https?:\/\//.test(opt.url)) throw new UsageError(`--url ${opt.url}: expected http://host:port or https://...`);
  if (opt.endpoint !== 'completions' && opt.endpoint !== 'chat')
    throw new UsageError(`--endpoint ${opt.endpoint}: expected completions or chat`);
  if (opt.rate !== null && opt.rate <= 0) throw new UsageError(`--rate ${opt.rate}: must be above 0`);
  if (opt.concurrency !== null && opt.concurrency < 1) throw new UsageError('--concurrency 0: must be at least 1');
  if (opt.requests !== null && opt.duration !== null) throw new UsageError('--requests and --duration exclude each other');
  if (opt.requests === 0) throw new UsageError('--requests 0: must be at least 1');
  if (opt.duration !== null && opt.duration <= 0) throw new UsageError(`--duration ${opt.duration}: must be above 0`);
  if (opt.requests === null && opt.duration === null) opt.requests = 100;
  if (opt.rate === null && opt.concurrency === null) opt.concurrency = 1;
  if (opt.prompts !== null && opt.prompt !== null) throw new UsageError('--prompts and --prompt exclude each other');
  if (opt.prompts !== null && given.has('input-len'))
    throw new UsageError('--input-len applies to synthetic prompts, not to --prompts');
  if (opt.tokenPrompts !== null) {
    if (opt.prompts !== null || opt.prompt !== null)
      throw new UsageError('--token-prompts makes synthetic prompts: it excludes --prompts and --prompt');
    if (opt.endpoint !== 'completions')
      throw new UsageError('--token-prompts: token-id prompts go to --endpoint completions only (chat takes text messages)');
    if (opt.tokenPrompts < 2) throw new UsageError(`--token-prompts ${opt.tokenPrompts}: a vocabulary of at least 2 tokens`);
  }
  if (opt.workers < 1 || opt.workers > MAX_WORKERS)
    throw new UsageError(`--workers ${opt.workers}: must be between 1 and ${MAX_WORKERS}`);
  if (opt.timeout <= 0) throw new UsageError(`--timeout ${opt.timeout}: must be above 0`);
  if (opt.extra !== null) {
    let v;
    try {
      v = JSON.parse(opt.extra);
    } catch (e) {
      throw new UsageError(`--extra ${opt.extra}: not JSON (${e.message})`);
    }
    if (typeof v !== 'object' || v === null || Array.isArray(v))
      throw new UsageError(`--extra ${opt.extra}: must be a JSON object`);
    opt.extra = v;
  }
  return opt;
}

/* ---- deterministic draws ------------------------------------------------ */

// mulberry32: small, fast and the same on every platform, so one --seed
// reproduces the same prompts, lengths and arrival times.
function makeRng(seed) {
  let s = seed >>> 0;
  return () => {
    s = (s + 0x6d2b79f5) >>> 0;
    let t = s;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const drawRange = (rng, r) => r.lo + Math.floor(rng() * (r.hi - r.lo + 1));

// Common short English words: in the 32k+ vocabularies of Llama, Mistral,
// Qwen or GPT each is one token with its leading space, so N words make a
// prompt of about N tokens there (a tiny vocabulary splits them further; the
// report gives the servers' own prompt token counts when they send usage).
const WORDS = (
  'the of and to in is was that for on it with as he be at by this had not are but from or have an they ' +
  'which one you were all we her she there would their will when who him been has more if no out so said ' +
  'what up its about into than them can only other time new some could these two may first then do any ' +
  'like my now over such our man me even most made after also did many off before must well back through ' +
  'years much where your way down should because long each just state people those how too little good ' +
  'world very still own see men work old day get here between both life being under never know same last'
).split(' ');

function syntheticPrompt(rng, words) {
  const out = [];
  for (let i = 0; i < words; i++) out.push(WORDS[Math.floor(rng() * WORDS.length)]);
  return out.join(' ');
}

// A prompt of n token ids below vocab, for servers that take token arrays
// as the completions prompt (llm-gateway, vLLM, llama-server): the length is
// exact on any tokenizer, so a run compares with bench_cluster's prompts of
// --prompt-tokens ids.  Ids start above the low ones where vocabularies keep
// special and byte tokens (from 300 when the vocabulary has more than 400,
// as bench_cluster draws them).
function tokenPrompt(rng, n, vocab) {
  const lo = vocab > 400 ? 300 : Math.min(3, vocab - 1);
  const out = new Array(n);
  for (let i = 0; i < n; i++) out[i] = lo + Math.floor(rng() * (vocab - lo));
  return out;
}

export function loadPrompts(path, endpoint) {
  let text;
  try {
    text = readFileSync(path, 'utf8');
  } catch (e) {
    throw new UsageError(`--prompts ${path}: ${e.message}`);
  }
  const items = [];
  text.split('\n').forEach((line, i) => {
    if (line.trim() === '') return;
    const where = `${path} line ${i + 1}`;
    let v;
    try {
      v = JSON.parse(line);
    } catch (e) {
      throw new UsageError(`${where}: not JSON (${e.message})`);
    }
    if (typeof v !== 'object' || v === null || Array.isArray(v)) throw new UsageError(`${where}: not a JSON object`);
    const item = {};
    if (typeof v.prompt === 'string') item.prompt = v.prompt;
    else if (Array.isArray(v.messages)) {
      if (endpoint === 'completions')
        throw new UsageError(`${where}: has "messages", which --endpoint completions cannot send (use --endpoint chat)`);
      item.messages = v.messages;
    } else throw new UsageError(`${where}: needs "prompt" (a string) or "messages" (a list)`);
    if (v.max_tokens !== undefined) {
      if (!Number.isInteger(v.max_tokens) || v.max_tokens < 1)
        throw new UsageError(`${where}: max_tokens ${JSON.stringify(v.max_tokens)} is not a whole number >= 1`);
      item.maxTokens = v.max_tokens;
    }
    items.push(item);
  });
  if (items.length === 0) throw new UsageError(`--prompts ${path}: no prompts in the file`);
  return items;
}

/* ---- one request -------------------------------------------------------- */

function baseUrl(url) {
  const u = url.replace(/\/+$/, '');
  return /\/v\d+$/.test(u) ? u : u + '/v1';
}

function headers(opt) {
  const h = { 'Content-Type': 'application/json', Accept: 'text/event-stream' };
  if (opt.apiKey) h.Authorization = `Bearer ${opt.apiKey}`;
  return h;
}

// The request body for item i of the load.
function makeBody(opt, model, item) {
  const body = { model, max_tokens: item.maxTokens, temperature: opt.temperature, stream: true };
  if (opt.endpoint === 'chat') body.messages = item.messages ?? [{ role: 'user', content: item.prompt }];
  else body.prompt = item.prompt;
  if (!opt.noUsage) body.stream_options = { include_usage: true };
  if (opt.ignoreEos) body.ignore_eos = true;
  return opt.extra ? { ...body, ...opt.extra } : body;
}

// The text a streamed chunk carries: completions put it in choices[].text,
// chat in choices[].delta.content (reasoning models also in
// delta.reasoning_content, which is generated output all the same).
function chunkText(choice) {
  if (typeof choice.text === 'string') return choice.text;
  const d = choice.delta;
  if (!d) return '';
  return (typeof d.content === 'string' ? d.content : '') + (typeof d.reasoning_content === 'string' ? d.reasoning_content : '');
}

// A Server-Sent Events parser over decoded text: lines end with \n, \r\n or
// \r; "data:" lines of one event are joined with \n; a blank line ends the
// event; lines starting with ":" are comments; other fields are ignored.
export class SseParser {
  constructor(onEvent) {
    this.onEvent = onEvent;
    this.buf = '';
    this.data = null;
  }
  push(text) {
    this.buf += text;
    let start = 0;
    for (;;) {
      let i = start;
      while (i < this.buf.length && this.buf[i] !== '\n' && this.buf[i] !== '\r') i++;
      if (i >= this.buf.length) break;
      // a \r at the very end may be the first half of \r\n: wait for more
      if (this.buf[i] === '\r' && i + 1 >= this.buf.length) break;
      const line = this.buf.slice(start, i);
      start = i + (this.buf[i] === '\r' && this.buf[i + 1] === '\n' ? 2 : 1);
      this.line(line);
    }
    this.buf = this.buf.slice(start);
  }
  line(line) {
    if (line === '') {
      if (this.data !== null) this.onEvent(this.data);
      this.data = null;
      return;
    }
    if (line[0] === ':') return;
    const c = line.indexOf(':');
    const field = c < 0 ? line : line.slice(0, c);
    let value = c < 0 ? '' : line.slice(c + 1);
    if (value[0] === ' ') value = value.slice(1);
    if (field === 'data') this.data = this.data === null ? value : this.data + '\n' + value;
  }
  end() {
    if (this.buf !== '') this.line(this.buf);
    this.buf = '';
    this.line('');
  }
}

// Kept-alive connections, as many as requests in flight: a measured request
// does not wait for a TCP (or TLS) handshake once the warm-up or an earlier
// request opened its connection.
const agents = { 'http:': new http.Agent({ keepAlive: true }), 'https:': new https.Agent({ keepAlive: true }) };

// Sends one streamed request and measures it.  Never throws: a failure comes
// back as { ok: false, error: "HTTP 429" | "network: ..." | "stream: ..." }.
//
// node:http rather than fetch, so that the clocks are read at the socket:
// a request's starts when it is given its connection, right before it is
// written, and a token's time is that of the socket read that completed its
// event, before the HTTP parser, the decoder and the SSE parser run.  What
// this client spends building a request and parsing a response is not the
// server's latency, and fetch's web streams put promise turns of the event
// loop between a read and its chunk (at concurrency 1 fetch added about a
// millisecond to TTFT against the same server; more when the loop is busy
// with other streams).
function runRequest(opt, url, body) {
  const r = { ok: false, error: null, detail: '', ttft: null, e2e: null, gaps: [], chunks: 0,
              usageTokens: null, promptTokens: null, finish: null, tokens: 0 };
  const payload = Buffer.from(JSON.stringify(body));
  const u = new URL(url);
  const mod = u.protocol === 'https:' ? https : http;
  return new Promise((resolve) => {
    let settled = false;
    let timer = null;
    let sock = null;
    const finish = () => {
      if (settled) return;
      settled = true;
      clearTimeout(timer);
      // the connection goes on to serve other requests
      if (sock) sock.removeListener('data', stamp);
      resolve(r);
    };
    const failNetwork = (e) => {
      if (settled) return;
      r.error = `network: ${e.code ?? e.message}`;
      r.detail = String(e.message).slice(0, 200);
      finish();
    };
    let last = null;
    let t0 = performance.now();
    // the time of the socket's latest read (a listener ahead of the parser's)
    let arrival = t0;
    const stamp = () => {
      arrival = performance.now();
    };
    const req = mod.request(u, {
      method: 'POST',
      agent: agents[u.protocol],
      headers: { ...headers(opt), 'Content-Length': payload.length },
    }, (res) => {
      const ct = res.headers['content-type'] ?? '';
      if (res.statusCode !== 200 || !ct.startsWith('text/event-stream')) {
        const parts = [];
        res.on('data', (b) => parts.push(b));
        res.on('error', failNetwork);
        res.on('end', () => {
          const text = Buffer.concat(parts).toString('utf8');
          if (res.statusCode !== 200) {
            r.error = `HTTP ${res.statusCode}`;
            try {
              r.detail = JSON.parse(text).error?.message ?? text;
            } catch {
              r.detail = text;
            }
            r.detail = String(r.detail).slice(0, 200);
          } else {
            r.error = 'stream: not text/event-stream';
            r.detail = `content-type "${ct}"`;
          }
          finish();
        });
        return;
      }
      let done = false;
      let streamError = null;
      const parser = new SseParser((data) => {
        if (done || streamError) return;
        if (data === '[DONE]') {
          done = true;
          return;
        }
        let ev;
        try {
          ev = JSON.parse(data);
        } catch {
          streamError = ['stream: event is not JSON', data.slice(0, 200)];
          return;
        }
        if (ev.error) {
          streamError = ['stream: error event', String(ev.error.message ?? JSON.stringify(ev.error)).slice(0, 200)];
          return;
        }
        if (ev.usage && typeof ev.usage.completion_tokens === 'number') {
          r.usageTokens = ev.usage.completion_tokens;
          if (typeof ev.usage.prompt_tokens === 'number') r.promptTokens = ev.usage.prompt_tokens;
        }
        for (const choice of ev.choices ?? []) {
          if (choice.finish_reason) r.finish = choice.finish_reason;
          if (chunkText(choice) === '') continue;
          if (r.ttft === null) r.ttft = arrival - t0;
          else r.gaps.push(arrival - last);
          last = arrival;
          r.chunks++;
        }
      });
      const decoder = new TextDecoder();
      res.on('data', (bytes) => parser.push(decoder.decode(bytes, { stream: true })));
      res.on('error', failNetwork);
      res.on('end', () => {
        parser.push(decoder.decode());
        parser.end();
        r.e2e = performance.now() - t0;
        if (streamError) [r.error, r.detail] = streamError;
        else if (!done) r.error = 'stream: ended before [DONE]';
        else {
          r.ok = true;
          r.tokens = r.usageTokens ?? r.chunks;
        }
        finish();
      });
      // a connection cut mid-stream may end the response without 'end' or 'error'
      res.on('close', () => {
        if (settled || res.complete) return;
        r.error = 'network: connection closed mid-stream';
        r.detail = 'the server closed the connection before the response ended';
        finish();
      });
    });
    // emitted for each request given a connection (a new one or one kept
    // alive), just before the request is written to it
    req.on('socket', (s) => {
      sock = s;
      t0 = performance.now();
      arrival = t0;
      s.prependListener('data', stamp);
    });
    timer = setTimeout(() => {
      if (settled) return;
      r.error = 'timeout';
      r.detail = `no complete answer within ${opt.timeout} s`;
      finish();
      req.destroy();
    }, opt.timeout * 1000);
    req.on('error', failNetwork);
    req.end(payload);
  });
}

/* ---- client threads ----------------------------------------------------- */

// Where requests run: run(body) sends one and resolves with its record.
// With --workers 1, on this thread, as runRequest alone.  With more, on
// worker threads of their own (each loads this module, hence has its own
// kept-alive agents and event loop): one event loop reading every stream
// stamps a token's socket read only when it gets to that socket's 'data'
// handler, and at 64 streams of thousands of events a second it is late by
// the other streams' parsing.  This thread keeps the schedule, the draws
// and the cap; a worker only sends what it is handed, times it as
// runRequest does and posts the record back.
//
// A request goes to the worker with the fewest in flight, ties to the next
// after the last one chosen, so that no thread reads more than its share of
// the streams in flight, whatever their lengths: in a closed loop of a
// multiple of --workers streams, the request that follows one that ended
// goes to the thread it left.  Which thread reads a stream changes nothing
// the server sees: the same arrival times and bodies as with one thread.
async function makePool(opt, url) {
  if (opt.workers === 1) return { run: (body) => runRequest(opt, url, body), close: async () => {} };
  const workers = [];
  const load = new Array(opt.workers).fill(0);
  const pending = new Map();
  let last = opt.workers - 1;
  let nextId = 0;
  const ready = [];
  for (let k = 0; k < opt.workers; k++) {
    const w = new Worker(new URL(import.meta.url), { workerData: { serveBenchWorker: true, opt, url } });
    ready.push(new Promise((resolve, reject) => {
      w.once('online', resolve);
      w.once('error', reject);
    }));
    w.on('message', ({ id, r }) => {
      const done = pending.get(id);
      pending.delete(id);
      load[k]--;
      r.worker = k;
      done(r);
    });
    // a worker that dies leaves requests that never end: nothing to report
    w.on('error', (e) => {
      process.stderr.write(`serve-bench: worker ${k}: ${e.stack ?? e}\n`);
      process.exit(1);
    });
    workers.push(w);
  }
  await Promise.all(ready);
  return {
    run(body) {
      let k = (last + 1) % opt.workers;
      for (let j = 1, i = k; j < opt.workers; j++) {
        i = (i + 1) % opt.workers;
        if (load[i] < load[k]) k = i;
      }
      last = k;
      load[k]++;
      const id = nextId++;
      return new Promise((resolve) => {
        pending.set(id, resolve);
        workers[k].postMessage({ id, body });
      });
    },
    close: () => Promise.all(workers.map((w) => w.terminate())),
  };
}

// A worker thread: runs each request it is handed, posts its record back.
function workerMain({ opt, url }) {
  parentPort.on('message', async ({ id, body }) => {
    parentPort.postMessage({ id, r: await runRequest(opt, url, body) });
  });
}

/* ---- the load ----------------------------------------------------------- */

const sleep = (ms) => new Promise((res) => setTimeout(res, Math.max(0, ms)));

// The items of the load in order: prompt and max_tokens of each request.
function makeItems(opt) {
  const rng = makeRng(opt.seed);
  const file = opt.prompts !== null ? loadPrompts(opt.prompts, opt.endpoint) : null;
  let n = 0;
  return () => {
    const i = n++;
    let item;
    if (file) item = { ...file[i % file.length] };
    else if (opt.prompt !== null) item = { prompt: opt.prompt };
    else if (opt.tokenPrompts !== null) item = { prompt: tokenPrompt(rng, drawRange(rng, opt.inputLen), opt.tokenPrompts) };
    else item = { prompt: syntheticPrompt(rng, drawRange(rng, opt.inputLen)) };
    // drawn for every request, so that the lengths do not depend on the file
    const maxTokens = drawRange(rng, opt.outputLen);
    item.maxTokens ??= maxTokens;
    return item;
  };
}

// Runs the load and returns the records of the measured requests, the wall
// time from the first send to the last answer, and the arrival schedule used.
async function runLoad(opt, pool, model, progress) {
  const next = makeItems(opt);
  const results = [];
  const deadline = opt.duration !== null ? opt.duration * 1000 : Infinity;
  const total = opt.requests ?? Infinity;
  let sent = 0;
  const t0 = performance.now();
  const one = async (item) => {
    const r = await pool.run(makeBody(opt, model, item));
    r.maxTokens = item.maxTokens;
    results.push(r);
    progress(results);
  };
  if (opt.rate === null) {
    // Closed loop: each of N lanes sends its next request when the last ends.
    const lane = async () => {
      while (sent < total && performance.now() - t0 < deadline) {
        sent++;
        await one(next());
      }
    };
    await Promise.all(Array.from({ length: opt.concurrency }, lane));
  } else {
    // Open loop: request k is due at the k-th point of a Poisson process of
    // the given rate (exponential gaps from the seeded generator), whatever
    // the server's state.  With --concurrency as well, a due request waits
    // for a free slot and its clock starts when it is sent.
    const rng = makeRng(opt.seed ^ 0x5bd1e995);
    const inflight = new Set();
    let due = 0;
    while (sent < total) {
      due += (-Math.log(1 - rng()) / opt.rate) * 1000;
      if (due >= deadline) break;
      await sleep(t0 + due - performance.now());
      while (opt.concurrency !== null && inflight.size >= opt.concurrency) await Promise.race(inflight);
      sent++;
      const p = one(next()).finally(() => inflight.delete(p));
      inflight.add(p);
    }
    await Promise.all(inflight);
  }
  return { results, wallMs: performance.now() - t0 };
}

/* ---- statistics and the report ------------------------------------------ */

// Percentile by linear interpolation between the closest ranks (numpy's
// default), over a sorted array.
function percentile(sorted, p) {
  if (sorted.length === 0) return null;
  const x = (p / 100) * (sorted.length - 1);
  const lo = Math.floor(x);
  const hi = Math.min(lo + 1, sorted.length - 1);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (x - lo);
}

function summary(values) {
  const s = values.filter((v) => v !== null && Number.isFinite(v)).sort((a, b) => a - b);
  if (s.length === 0) return { n: 0, mean: null, p50: null, p90: null, p99: null, min: null, max: null };
  const mean = s.reduce((a, b) => a + b, 0) / s.length;
  return { n: s.length, mean, p50: percentile(s, 50), p90: percentile(s, 90), p99: percentile(s, 99),
           min: s[0], max: s[s.length - 1] };
}

const count = (arr, key) => arr.reduce((m, x) => ((m[key(x)] = (m[key(x)] ?? 0) + 1), m), {});

export function report(opt, url, model, results, wallMs) {
  const ok = results.filter((r) => r.ok);
  const failed = results.filter((r) => !r.ok);
  const withUsage = ok.filter((r) => r.usageTokens !== null).length;
  const source = ok.length === 0 ? 'none' : withUsage === ok.length ? 'usage' : withUsage === 0 ? 'chunks' : 'mixed';
  const outTokens = ok.reduce((a, r) => a + r.tokens, 0);
  const promptKnown = ok.filter((r) => r.promptTokens !== null);
  const promptTokens = promptKnown.reduce((a, r) => a + r.promptTokens, 0);
  const chunks = ok.reduce((a, r) => a + r.chunks, 0);
  const sec = wallMs / 1000;
  const errorDetail = {};
  for (const r of failed) errorDetail[r.error] ??= r.detail;
  return {
    url,
    model,
    endpoint: opt.endpoint,
    load: opt.rate !== null ? { mode: 'poisson', rate: opt.rate, max_concurrency: opt.concurrency }
                            : { mode: 'concurrency', concurrency: opt.concurrency },
    workers: opt.workers,
    requests_per_worker: results.reduce((a, r) => (a[r.worker ?? 0]++, a), new Array(opt.workers).fill(0)),
    requests_planned: opt.requests,
    duration_planned_s: opt.duration,
    ignore_eos: opt.ignoreEos,
    requests: { total: results.length, ok: ok.length, failed: failed.length },
    errors: count(failed, (r) => r.error),
    error_examples: errorDetail,
    finish_reasons: count(ok, (r) => r.finish ?? 'none'),
    short_of_max_tokens: ok.filter((r) => r.tokens < r.maxTokens).length,
    duration_s: sec,
    token_count_source: source,
    requests_with_usage: withUsage,
    output_tokens: outTokens,
    output_chunks: chunks,
    prompt_tokens: promptKnown.length === ok.length && ok.length > 0 ? promptTokens : null,
    request_throughput: ok.length / sec,
    output_throughput: outTokens / sec,
    prompt_throughput: promptKnown.length === ok.length && ok.length > 0 ? promptTokens / sec : null,
    ttft_ms: summary(ok.map((r) => r.ttft)),
    tpot_ms: summary(ok.map((r) => (r.tokens > 1 && r.ttft !== null ? (r.e2e - r.ttft) / (r.tokens - 1) : null))),
    itl_ms: summary(ok.flatMap((r) => r.gaps)),
    e2e_ms: summary(ok.map((r) => r.e2e)),
  };
}

const fmt = (v, d = 1) => (v === null || v === undefined ? '-' : v.toFixed(d));

export function formatTable(s) {
  const L = [];
  const load = s.load.mode === 'poisson'
    ? `Poisson arrivals at ${s.load.rate} req/s` + (s.load.max_concurrency ? `, at most ${s.load.max_concurrency} in flight` : '')
    : `concurrency ${s.load.concurrency}`;
  L.push(`serve-bench  ${s.url}  model ${s.model}  (${s.endpoint}, streamed)`);
  const threads = s.workers > 1 ? ` from ${s.workers} client threads` : '';
  L.push(`load         ${load}; ${s.requests.total} requests${threads} in ${fmt(s.duration_s, 2)} s`);
  L.push(`requests     ${s.requests.ok} ok, ${s.requests.failed} failed`);
  const why = { usage: 'the usage object of every stream', chunks: 'streamed chunks (the server sent no usage)',
                mixed: `the usage object of ${s.requests_with_usage} streams, chunks for the others`, none: '-' };
  L.push(`tokens       ${s.output_tokens} generated, counted from ${why[s.token_count_source]}` +
         (s.prompt_tokens !== null ? `; ${s.prompt_tokens} prompt` : ''));
  L.push(`throughput   ${fmt(s.request_throughput, 2)} req/s   ${fmt(s.output_throughput, 1)} output tok/s` +
         (s.prompt_throughput !== null ? `   ${fmt(s.prompt_throughput, 1)} prompt tok/s` : ''));
  if (s.short_of_max_tokens > 0)
    L.push(`short        ${s.short_of_max_tokens} requests ended before max_tokens` + (s.ignore_eos ? '' : ' (--ignore-eos makes every request run to max_tokens)'));
  L.push('');
  L.push('latency (ms)       mean      p50      p90      p99      max        n');
  const row = (name, x) => L.push(name.padEnd(14) + [x.mean, x.p50, x.p90, x.p99, x.max].map((v) => fmt(v, 2).padStart(9)).join('') + String(x.n).padStart(9));
  row('TTFT', s.ttft_ms);
  row('TPOT', s.tpot_ms);
  row('ITL', s.itl_ms);
  row('E2E', s.e2e_ms);
  if (s.output_chunks !== s.output_tokens && s.token_count_source === 'usage')
    L.push(`(ITL is between chunks: ${s.output_tokens} tokens came in ${s.output_chunks} chunks)`);
  L.push('');
  L.push('finish       ' + (Object.entries(s.finish_reasons).map(([k, v]) => `${k} ${v}`).join(', ') || '-'));
  if (s.requests.failed > 0) {
    L.push('errors');
    for (const [k, v] of Object.entries(s.errors))
      L.push(`  ${String(v).padStart(6)}  ${k}` + (s.error_examples[k] ? `: ${s.error_examples[k]}` : ''));
  }
  return L.join('\n');
}

/* ---- main --------------------------------------------------------------- */

async function pickModel(opt, base) {
  if (opt.model) return opt.model;
  let res;
  try {
    res = await fetch(base + '/models', { headers: headers(opt), signal: AbortSignal.timeout(30000) });
  } catch (e) {
    throw new UsageError(`GET ${base}/models: ${e.cause?.message ?? e.message} (give --model to skip it)`);
  }
  const text = await res.text();
  if (res.status !== 200) throw new UsageError(`GET ${base}/models: HTTP ${res.status}: ${text.slice(0, 200)} (give --model)`);
  let id;
  try {
    id = JSON.parse(text).data?.[0]?.id;
  } catch {}
  if (typeof id !== 'string') throw new UsageError(`GET ${base}/models: no model in ${text.slice(0, 200)} (give --model)`);
  return id;
}

async function main() {
  const opt = parseArgs(process.argv.slice(2));
  if (opt.help) {
    console.log(usage());
    return 0;
  }
  const base = baseUrl(opt.url);
  const url = base + (opt.endpoint === 'chat' ? '/chat/completions' : '/completions');
  if (opt.prompts !== null) loadPrompts(opt.prompts, opt.endpoint); // its errors before any traffic
  const model = await pickModel(opt, base);
  const pool = await makePool(opt, url);
  if (opt.warmup > 0) {
    // As many at a time as the load will have in flight (capped by the
    // warm-up's size), so that the connections the load needs are open
    // before the clock starts: this client's, and the server's own towards
    // its backends (llm-gateway opens a router connection per concurrent
    // request the first time).  With --workers, through the same threads
    // as the load, each opening its share of the connections.
    const next = makeItems({ ...opt, seed: opt.seed + 1 });
    let i = 0;
    const lane = async () => {
      while (i < opt.warmup) {
        const k = ++i;
        const r = await pool.run(makeBody(opt, model, next()));
        if (!r.ok) process.stderr.write(`serve-bench: warm-up request ${k} failed: ${r.error} ${r.detail}\n`);
      }
    };
    await Promise.all(Array.from({ length: Math.min(opt.warmup, opt.concurrency ?? 1) }, lane));
  }
  let lastShown = 0;
  const progress = (results) => {
    if (opt.quiet || !process.stderr.isTTY) return;
    const now = performance.now();
    if (now - lastShown < 250) return;
    lastShown = now;
    const bad = results.filter((r) => !r.ok).length;
    process.stderr.write(`\r${results.length} done, ${bad} failed `);
  };
  const { results, wallMs } = await runLoad(opt, pool, model, progress);
  await pool.close();
  if (!opt.quiet && process.stderr.isTTY) process.stderr.write('\r\x1b[K');
  const s = report(opt, url, model, results, wallMs);
  console.log(formatTable(s));
  if (opt.json) writeFileSync(opt.json, JSON.stringify(s, null, 2) + '\n');
  return s.requests.ok > 0 ? 0 : 1;
}

// Run as a program, not when imported (the tests import the SSE parser);
// as a worker when makePool starts this module on a thread.
if (!isMainThread && workerData?.serveBenchWorker) workerMain(workerData);
else if (isMainThread && process.argv[1] && import.meta.url === pathToFileURL(realpathSync(process.argv[1])).href) {
  main().then(
    (rc) => process.exit(rc),
    (e) => {
      if (e instanceof UsageError) {
        process.stderr.write(`serve-bench: ${e.message}\n`);
        process.exit(2);
      }
      process.stderr.write(`serve-bench: ${e.stack ?? e}\n`);
      process.exit(1);
    },
  );
}
