// Drives llm-gateway with the official openai npm package, as an
// application would.  Started by tests/gateway/test_gateway.c with:
//   GW_URL       gateway with the model's own (absent) chat template, API key GW_KEY
//   GW_CHAT_URL  gateway with --chat-template chatml, no API key
//   GW_MODEL     the model name both serve
//   GW_PROMPT, GW_MAX_TOKENS, GW_EXPECT_TEXT  llm-run's greedy output for the prompt
// Exits 0 when every check passes; prints what differed otherwise.
import OpenAI from 'openai';

const env = (k) => {
  if (!process.env[k]) throw new Error(`${k} is not set`);
  return process.env[k];
};
const model = env('GW_MODEL');
const prompt = env('GW_PROMPT');
const maxTokens = Number(env('GW_MAX_TOKENS'));
const expectText = env('GW_EXPECT_TEXT');

let failures = 0;
function check(cond, what) {
  if (cond) {
    console.log(`ok: ${what}`);
  } else {
    console.log(`FAILED: ${what}`);
    failures++;
  }
}

const client = new OpenAI({ baseURL: env('GW_URL') + '/v1', apiKey: env('GW_KEY'), maxRetries: 0 });
const chatClient = new OpenAI({ baseURL: env('GW_CHAT_URL') + '/v1', apiKey: 'unused', maxRetries: 0 });

// Models.
const models = await client.models.list();
check(models.data.some((m) => m.id === model), `models.list has ${model}: ${JSON.stringify(models.data)}`);

// Completions, not streamed: llm-run's text at temperature 0.
const c = await client.completions.create({ model, prompt, max_tokens: maxTokens, temperature: 0 });
check(c.object === 'text_completion', `completion object ${c.object}`);
check(c.choices[0].text === expectText, `completion text ${JSON.stringify(c.choices[0].text)} == llm-run's ${JSON.stringify(expectText)}`);
check(c.usage.completion_tokens === maxTokens, `completion_tokens ${c.usage.completion_tokens} == ${maxTokens}`);
check(c.choices[0].finish_reason === 'length', `finish_reason ${c.choices[0].finish_reason}`);

// Completions, streamed, with usage at the end.
const stream = await client.completions.create({
  model, prompt, max_tokens: maxTokens, temperature: 0, stream: true, stream_options: { include_usage: true },
});
let text = '';
let usage = null;
let finish = null;
for await (const chunk of stream) {
  if (chunk.usage) usage = chunk.usage;
  for (const ch of chunk.choices) {
    text += ch.text;
    if (ch.finish_reason) finish = ch.finish_reason;
  }
}
check(text === expectText, `streamed completion ${JSON.stringify(text)} == llm-run's`);
check(usage && usage.completion_tokens === maxTokens, `streamed usage ${JSON.stringify(usage)}`);
check(finish === 'length', `streamed finish_reason ${finish}`);

// Chat on a model without a recognised template: the clear error.
for (const streamed of [false, true]) {
  try {
    const r = await client.chat.completions.create({
      model, messages: [{ role: 'user', content: 'Hi' }], max_tokens: 4, stream: streamed,
    });
    if (streamed) for await (const _ of r) { /* drain */ }
    check(false, `chat (stream ${streamed}) without a template was refused`);
  } catch (e) {
    check(e instanceof OpenAI.APIError && e.status === 400, `chat (stream ${streamed}) refused with 400 (got ${e.status})`);
    check(e.code === 'chat_template_not_found' && /--chat-template/.test(e.message) && e.message.includes(model),
          `chat error names the model and the flag: ${e.message}`);
  }
}

// Chat through a template chosen with --chat-template: non-streamed and
// streamed give the same greedy answer.
const messages = [{ role: 'system', content: 'You tell stories.' }, { role: 'user', content: 'Once upon a time' }];
const cc = await chatClient.chat.completions.create({ model, messages, max_tokens: 12, temperature: 0 });
check(cc.object === 'chat.completion', `chat object ${cc.object}`);
check(cc.choices[0].message.role === 'assistant', `chat role ${cc.choices[0].message.role}`);
check(typeof cc.choices[0].message.content === 'string' && cc.choices[0].message.content.length > 0,
      `chat content ${JSON.stringify(cc.choices[0].message.content)}`);
check(cc.usage.completion_tokens > 0 && cc.usage.prompt_tokens > 0, `chat usage ${JSON.stringify(cc.usage)}`);
const cs = await chatClient.chat.completions.create({
  model, messages, max_tokens: 12, temperature: 0, stream: true, stream_options: { include_usage: true },
});
let content = '';
let role = null;
let chatUsage = null;
for await (const chunk of cs) {
  if (chunk.usage) chatUsage = chunk.usage;
  for (const ch of chunk.choices) {
    if (ch.delta.role) role = ch.delta.role;
    if (ch.delta.content) content += ch.delta.content;
  }
}
check(role === 'assistant', `streamed chat role ${role}`);
check(content === cc.choices[0].message.content, `streamed chat ${JSON.stringify(content)} == non-streamed`);
check(chatUsage && chatUsage.completion_tokens === cc.usage.completion_tokens, `streamed chat usage ${JSON.stringify(chatUsage)}`);

// Logprobs with token text: the tokens together are the output text.
const lc = await client.completions.create({ model, prompt, max_tokens: maxTokens, temperature: 0, logprobs: 2 });
const lpc = lc.choices[0].logprobs;
check(lpc && lpc.tokens.length === maxTokens && lpc.token_logprobs.length === maxTokens &&
      lpc.top_logprobs.length === maxTokens && lpc.text_offset.length === maxTokens,
      `completion logprobs have ${maxTokens} entries: ${JSON.stringify(lpc).slice(0, 200)}`);
check(lpc && lpc.tokens.join('') === lc.choices[0].text, `completion tokens ${JSON.stringify(lpc && lpc.tokens)} make the text`);
check(lpc && lpc.token_logprobs.every((x) => x <= 0) && lpc.top_logprobs.every((d) => Object.keys(d).length >= 1),
      'completion logprobs are <= 0, with alternatives');
check(lpc && lpc.text_offset[0] === 0 && lpc.text_offset.every((o, i) => i === 0 || o >= lpc.text_offset[i - 1]),
      `completion text_offset ${JSON.stringify(lpc && lpc.text_offset)}`);
const lcc = await chatClient.chat.completions.create({
  model, messages, max_tokens: 12, temperature: 0, logprobs: true, top_logprobs: 3,
});
const lpcc = lcc.choices[0].logprobs;
check(lpcc && Array.isArray(lpcc.content) && lpcc.content.length === lcc.usage.completion_tokens,
      `chat logprobs.content has one entry per token: ${JSON.stringify(lpcc).slice(0, 200)}`);
const chatBytes = lpcc ? Buffer.from(lpcc.content.flatMap((t) => t.bytes)).toString('utf8') : null;
check(chatBytes === lcc.choices[0].message.content, `chat tokens' bytes ${JSON.stringify(chatBytes)} make the content`);
check(lpcc && lpcc.content.every((t) => t.top_logprobs.length === 3 && typeof t.token === 'string' && t.logprob <= 0),
      'chat tokens have 3 alternatives each');
const ls = await client.completions.create({
  model, prompt, max_tokens: maxTokens, temperature: 0, logprobs: 1, stream: true,
});
let lsText = '';
let lsTokens = '';
for await (const chunk of ls) {
  for (const ch of chunk.choices) {
    lsText += ch.text;
    if (ch.logprobs) lsTokens += ch.logprobs.tokens.join('');
  }
}
check(lsText === expectText && lsTokens === lsText, `streamed logprobs tokens ${JSON.stringify(lsTokens)} make the text`);

// n = 2: two choices, indexes 0 and 1 (docs/protocol.md, "Several choices").
{
  const r = await client.completions.create({ model, prompt, max_tokens: 4, n: 2, temperature: 1, seed: 3 });
  check(r.choices.length === 2 && r.choices[0].index === 0 && r.choices[1].index === 1,
        `n = 2 gives choices 0 and 1: ${JSON.stringify(r.choices.map((c) => c.index))}`);
}

// A refused parameter comes back as an APIError naming it.
try {
  await client.completions.create({ model, prompt, max_tokens: 4, best_of: 2 });
  check(false, 'best_of = 2 was refused');
} catch (e) {
  check(e.status === 400 && e.param === 'best_of', `best_of = 2 refused with 400, param ${e.param}: ${e.message}`);
}

// A prompt longer than the context: the code SDK users branch on, and a
// message without libllmclient's "generate: INVALID_ARGUMENT" wrapping.
try {
  await client.completions.create({ model, prompt: 'dog '.repeat(3000), max_tokens: 4 });
  check(false, 'a 3000-word prompt was refused');
} catch (e) {
  check(e instanceof OpenAI.BadRequestError && e.code === 'context_length_exceeded' && e.param === 'prompt' &&
        !/INVALID_ARGUMENT|\(request /.test(e.message),
        `a 3000-word prompt refused with context_length_exceeded: ${e.status} ${e.code} ${e.message}`);
}

// A streamed chat opens with the role alone, then text.
const rs = await chatClient.chat.completions.create({ model, messages, max_tokens: 4, temperature: 0, stream: true });
const firsts = [];
for await (const chunk of rs) firsts.push(chunk.choices[0]?.delta ?? {});
check(firsts.length >= 2 && firsts[0].role === 'assistant' && firsts[0].content === '' &&
      firsts.slice(1).every((d) => d.role === undefined),
      `streamed chat opens with the role alone: ${JSON.stringify(firsts.slice(0, 3))}`);

// Predicted outputs: OpenAI's usage.completion_tokens_details fields, as
// the SDK hands them over.  llm-run's text as the completion's prediction,
// the non-streamed chat answer as the streamed chat's.
{
  const isCount = (x) => Number.isInteger(x) && x >= 0;
  const pc = await client.completions.create({
    model, prompt, max_tokens: maxTokens, temperature: 0, prediction: { type: 'content', content: expectText },
  });
  const d = pc.usage?.completion_tokens_details;
  check(pc.choices[0].text === expectText && d && isCount(d.accepted_prediction_tokens) &&
        isCount(d.rejected_prediction_tokens) && d.accepted_prediction_tokens > 0 &&
        d.rejected_prediction_tokens * 6 <= d.accepted_prediction_tokens,
        `completion with a right prediction: ${JSON.stringify(pc.usage)}`);
  const ps = await chatClient.chat.completions.create({
    model, messages, max_tokens: 12, temperature: 0, stream: true, stream_options: { include_usage: true },
    prediction: { type: 'content', content: cc.choices[0].message.content },
  });
  let psText = '';
  let psUsage = null;
  for await (const chunk of ps) {
    if (chunk.usage) psUsage = chunk.usage;
    for (const ch of chunk.choices) if (ch.delta.content) psText += ch.delta.content;
  }
  const sd = psUsage?.completion_tokens_details;
  check(psText === cc.choices[0].message.content && sd && isCount(sd.accepted_prediction_tokens) &&
        isCount(sd.rejected_prediction_tokens) && sd.accepted_prediction_tokens + sd.rejected_prediction_tokens > 0,
        `streamed chat with a prediction: ${JSON.stringify(psUsage)}`);
  check(cc.usage.completion_tokens_details === undefined,
        `no completion_tokens_details without a prediction: ${JSON.stringify(cc.usage)}`);
}

if (failures > 0) {
  console.log(`${failures} check(s) failed`);
  process.exit(1);
}
console.log('all checks passed');
