// Structured outputs through llm-gateway with the official openai npm
// package, every output checked by ajv (a real JSON Schema validator):
// response_format json_schema (strict and not) and json_object, greedy and
// sampled, streamed and not, and n > 1 choices.  An output that finished with "stop" must be
// valid; one that finished with "length" hit max_tokens and may be cut
// inside the structure (as OpenAI's API says), so it is only counted.
// Run by tests/gateway/test_gateway.c (GW_CHAT_URL, GW_MODEL).
import OpenAI from "openai";
import Ajv from "ajv";

const client = new OpenAI({ baseURL: process.env.GW_CHAT_URL + "/v1", apiKey: "none", maxRetries: 0 });
const model = process.env.GW_MODEL;
const ajv = new Ajv({ strict: false });

// Bounded (maxLength, maxItems, enums) so that a tiny model can finish.
const schemas = [
  {
    type: "object",
    properties: { name: { type: "string", maxLength: 8 }, age: { type: "integer" }, ok: { type: "boolean" } },
    required: ["name", "age", "ok"],
    additionalProperties: false,
  },
  {
    type: "object",
    properties: {
      color: { enum: ["red", "green", "blue"] },
      tags: { type: "array", items: { type: "string", maxLength: 4 }, minItems: 1, maxItems: 3 },
      note: { anyOf: [{ type: "null" }, { type: "string", maxLength: 5 }] },
      size: { type: "number" },
    },
    required: ["color", "tags"],
    additionalProperties: false,
  },
  {
    type: "object",
    properties: {
      kind: { const: "pet" },
      owner: {
        type: "object",
        properties: { first: { type: "string", minLength: 1, maxLength: 6 }, nil: { type: "null" } },
        required: ["first"],
        additionalProperties: false,
      },
      legs: { type: "array", items: { type: "integer" }, maxItems: 2 },
    },
    required: ["kind", "owner"],
    additionalProperties: false,
  },
];

let stops = 0, lengths = 0, invalid = 0, total = 0;

async function one(format, validate, temperature, seed, stream) {
  const req = {
    model,
    messages: [{ role: "user", content: "Pet" }],
    max_tokens: 160,
    temperature,
    seed,
    response_format: format,
  };
  let text = "", finish = null;
  if (stream) {
    const s = await client.chat.completions.create({ ...req, stream: true });
    for await (const ch of s) {
      for (const c of ch.choices) {
        if (c.delta?.content) text += c.delta.content;
        if (c.finish_reason) finish = c.finish_reason;
      }
    }
  } else {
    const r = await client.chat.completions.create(req);
    text = r.choices[0].message.content;
    finish = r.choices[0].finish_reason;
  }
  total++;
  if (finish === "length") {
    lengths++;
    return;
  }
  if (finish !== "stop") throw new Error(`finish_reason ${finish}: ${text}`);
  stops++;
  let v;
  try {
    v = JSON.parse(text);
  } catch (e) {
    invalid++;
    console.log(`not JSON (${JSON.stringify(format)}): ${JSON.stringify(text)}`);
    return;
  }
  if (!validate(v)) {
    invalid++;
    console.log(`invalid: ${JSON.stringify(text)}: ${ajv.errorsText(validate.errors)}`);
  }
}

const anyObject = (v) => v !== null && typeof v === "object" && !Array.isArray(v);

const jobs = [];
for (const [i, schema] of schemas.entries()) {
  const validate = ajv.compile(schema);
  for (const strict of [true, false]) {
    const format = { type: "json_schema", json_schema: { name: `s${i}`, strict, schema } };
    jobs.push(one(format, validate, 0, 0, strict));
    for (let seed = 1; seed <= 3; seed++) jobs.push(one(format, validate, 1.0, seed * 7 + i, seed % 2 === 0));
  }
}
for (let seed = 1; seed <= 3; seed++) jobs.push(one({ type: "json_object" }, anyObject, seed === 1 ? 0 : 1, seed, false));
await Promise.all(jobs);

// n > 1 (docs/protocol.md, "Several choices"): n choices with indexes
// 0..n-1, each checked like the others; the stream (chunks carry index)
// gives the same texts as the whole response for the same seed.
async function choices(format, validate, n, seed) {
  const req = { model, messages: [{ role: "user", content: "Pet" }], max_tokens: 160, temperature: 1.0, seed, n,
                response_format: format };
  const r = await client.chat.completions.create(req);
  if (r.choices.length !== n) throw new Error(`n = ${n}: ${r.choices.length} choices`);
  const texts = new Array(n).fill(""), finishes = new Array(n).fill(null);
  const s = await client.chat.completions.create({ ...req, stream: true });
  for await (const ch of s)
    for (const c of ch.choices) {
      if (!(c.index >= 0 && c.index < n)) throw new Error(`streamed choice index ${c.index} with n = ${n}`);
      if (c.delta?.content) texts[c.index] += c.delta.content;
      if (c.finish_reason) finishes[c.index] = c.finish_reason;
    }
  for (const [i, c] of r.choices.entries()) {
    if (c.index !== i) throw new Error(`choices[${i}].index = ${c.index}`);
    if (c.message.content !== texts[i] || c.finish_reason !== finishes[i])
      throw new Error(`choice ${i}: streamed ${JSON.stringify(texts[i])} (${finishes[i]}), whole ` +
                      `${JSON.stringify(c.message.content)} (${c.finish_reason})`);
    total++;
    if (c.finish_reason === "length") { lengths++; continue; }
    stops++;
    let v;
    try { v = JSON.parse(c.message.content); } catch (e) { v = undefined; }
    if (v === undefined || !validate(v)) {
      invalid++;
      console.log(`choice ${i} invalid: ${JSON.stringify(c.message.content)}`);
    }
  }
  if (new Set(texts).size < 2) console.log(`note: the ${n} sampled choices of seed ${seed} are one text`);
}
await choices({ type: "json_schema", json_schema: { name: "n0", strict: true, schema: schemas[0] } },
              ajv.compile(schemas[0]), 3, 11);
await choices({ type: "json_object" }, anyObject, 2, 5);

// Refusals name the parameter.
async function refused(req, param, what) {
  try {
    await client.chat.completions.create({ model, messages: [{ role: "user", content: "x" }], max_tokens: 4, ...req });
  } catch (e) {
    if (e.status !== 400) throw new Error(`${what}: status ${e.status}: ${e.message}`);
    if (param !== undefined && e.param !== param) throw new Error(`${what}: param ${e.param}, expected ${param}`);
    return;
  }
  throw new Error(`${what}: accepted`);
}
await refused({ response_format: { type: "json_schema", json_schema: { name: "x", schema: { type: "object", properties: { a: { type: "integer", minimum: 0 } } } } } },
  null, "unsupported keyword");
await refused({ response_format: { type: "json_object" }, stop: ["}"] }, "stop", "stop with a format");
await refused({ response_format: { type: "json_schema" } }, "response_format.json_schema", "no json_schema");
await refused({ response_format: { type: "xml" } }, "response_format.type", "unknown type");
await refused({ n: 17 }, "n", "n above 16");

console.log(`structured outputs: ${total} requests, ${stops} stop (all checked by ajv), ${lengths} length, ${invalid} invalid`);
if (invalid > 0) process.exit(1);
if (stops < total / 3) {
  console.log("fewer than a third finished: the schemas are meant to be small enough");
  process.exit(1);
}
