// Drives a server through the official `ollama` npm package, as a Node app would, and
// prints what it got back as one JSON object (tests/e2e/test_ollama_js.py reads it).
// Usage: node ollama_js_client.cjs <package folder> <server url> <chat model> <embed model>
"use strict";
const [packageFolder, host, model, embedModel] = process.argv.slice(2);
const { Ollama } = require(packageFolder);

const SYSTEM = "You are the help desk of a public library. Answer in one short sentence. ".repeat(4);
const GREEDY = { temperature: 0, num_predict: 8 };
const ask = (question) => [
  { role: "system", content: SYSTEM },
  { role: "user", content: question },
];

async function main() {
  const client = new Ollama({ host });
  const out = {};
  out.version = (await client.version()).version;
  out.models = (await client.list()).models.map((m) => m.model);
  out.capabilities = (await client.show({ model })).capabilities;
  out.first = await client.chat({ model, messages: ask("Where are the atlases?"), options: GREEDY });
  out.second = await client.chat({ model, messages: ask("When do you close?"), options: GREEDY });
  const parts = [];
  for await (const part of await client.chat({
    model,
    messages: ask("When do you close?"),
    options: GREEDY,
    stream: true,
  })) {
    parts.push(part);
  }
  out.streamed = parts.map((p) => p.message.content).join("");
  out.final = parts[parts.length - 1];
  out.generated = (
    await client.generate({ model, prompt: "When do you close?", system: SYSTEM, options: GREEDY })
  ).response;
  out.embeddings = (await client.embed({ model: embedModel, input: ["a page", "a note"] })).embeddings;
  out.running = (await client.ps()).models.map((m) => m.model);
  try {
    await client.chat({ model, messages: ask("Hi"), format: "yaml" });
    out.error = null;
  } catch (e) {
    out.error = { name: e.name, message: e.error, status: e.status_code };
  }
  process.stdout.write(JSON.stringify(out));
}

main().catch((e) => {
  process.stderr.write(String(e && e.stack ? e.stack : e));
  process.exit(1);
});
