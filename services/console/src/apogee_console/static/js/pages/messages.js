// Messages: send a test message, search by id / key / time range; ?id=X shows one message
// (&topic=T&broker=B&queue_id=Q&queue_offset=O: which copy, when the id is stored more than once).

import { api, seg } from "../api.js";
import { cut, field, fill, h, long, messagePage, num, put, show, table, time, ui, utcInput } from "../dom.js";

export const title = "Messages";

export async function render(ctx) {
  const id = ctx.params.get("id");
  if (id) return detail(ctx, id);
  return overview(ctx);
}

function keysOf(m) {
  return Array.isArray(m.keys) ? m.keys.join(" ") : show(m.keys);
}

/** The query of GET /messages/{id} that picks the copy the page's URL names. */
function copyQuery(params) {
  const q = new URLSearchParams();
  for (const name of ["topic", "broker", "queue_id", "queue_offset"]) {
    if (params.get(name)) q.set(name, params.get(name));
  }
  return q.toString() ? `?${q}` : "";
}

function where(c) {
  return `${show(c.broker)}, queue ${show(c.queue_id)}, offset ${show(c.queue_offset)}`;
}

/** Which copy the page shows and links to the others, when the id is stored more than once. */
function copiesNote(m) {
  const others = m.other_copies || [];
  if (!others.length) return null;
  return h(
    "p",
    { class: "note", testid: "message-copies" },
    `This id is stored ${others.length + 1} times. This is the copy in topic `,
    h("strong", { testid: "message-copy-topic" }, m.topic),
    ` (${where(m)}); ${others.length === 1 ? "another copy is" : "other copies are"} in topic `,
    others.map((c, i) => [
      i ? ", " : "",
      h("a", { href: messagePage(m.id, c), testid: "message-copy-link", "data-topic": c.topic }, c.topic),
      ` (${where(c)})`,
    ]),
    ".",
  );
}

function bodyView(body, testid = "message-body") {
  if (!body) return h("p", { class: "muted" }, "No body.");
  return h(
    "div",
    {},
    h(
      "p",
      { class: "muted small", testid: `${testid}-meta` },
      `${body.kind}, ${num(body.size)} bytes${body.truncated ? ", preview truncated" : ""}`,
    ),
    h("pre", { class: "body", testid }, body.preview),
  );
}

function parseProperties(text) {
  const out = {};
  for (const [i, raw] of text.split("\n").entries()) {
    const line = raw.trim();
    if (!line) continue;
    const at = line.indexOf("=");
    if (at <= 0) throw new Error(`properties: line ${i + 1} is not name=value: "${line}"`);
    out[line.slice(0, at).trim()] = line.slice(at + 1).trim();
  }
  return out;
}

function sendForm(ctx) {
  const topic = h("input", { testid: "send-topic", required: true, autocomplete: "off", value: ctx.params.get("topic") || "" });
  const tags = h("input", { testid: "send-tags", autocomplete: "off" });
  const keys = h("input", { testid: "send-keys", autocomplete: "off" });
  const props = h("textarea", { testid: "send-properties", rows: 2, placeholder: "name=value, one a line" });
  const body = h("textarea", { testid: "send-body", rows: 4, required: true });
  const submit = h("button", { type: "submit", testid: "send-submit" }, "Send");
  const result = h("div", { testid: "send-result", role: "status" });
  const form = h(
    "form",
    { class: "card", testid: "send-form", "aria-label": "Send a test message" },
    h("h2", {}, "Send a test message"),
    h("div", { class: "row" }, field("Topic", topic), field("Tag", tags), field("Keys", keys, "space-separated")),
    field("Properties", props),
    field("Body", body),
    h("div", { class: "actions" }, submit),
    result,
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    await ctx.act(submit, async () => {
      fill(result);
      const request = { topic: topic.value.trim(), body: body.value };
      if (tags.value.trim()) request.tags = tags.value.trim();
      const keyList = keys.value.split(/[\s,]+/).filter(Boolean);
      if (keyList.length) request.keys = keyList;
      const properties = parseProperties(props.value);
      if (Object.keys(properties).length) request.properties = properties;
      const sent = await api("POST", "/messages", request);
      fill(
        result,
        h(
          "p",
          {},
          "Sent ",
          h("a", { href: ui("messages", { id: sent.id }), testid: "send-result-link" }, sent.id),
          ` to queue ${show(sent.queue_id)}${sent.broker ? ` of ${sent.broker}` : ""}, offset ${show(sent.queue_offset)}.`,
        ),
      );
    });
  });
  return form;
}

function searchForm(ctx, results) {
  const by = h(
    "select",
    { testid: "search-by" },
    h("option", { value: "key" }, "key"),
    h("option", { value: "id" }, "message id"),
    h("option", { value: "time" }, "time range"),
  );
  const topic = h("input", { testid: "search-topic", autocomplete: "off", value: ctx.params.get("topic") || "" });
  const key = h("input", { testid: "search-key", autocomplete: "off" });
  const id = h("input", { testid: "search-id", autocomplete: "off", size: 34 });
  const begin = h("input", { testid: "search-begin", type: "datetime-local", step: 1 });
  const end = h("input", { testid: "search-end", type: "datetime-local", step: 1 });
  const limit = h("input", { testid: "search-limit", type: "number", min: 1, max: 1000, value: "50" });
  const fields = {
    topic: field("Topic", topic),
    key: field("Key", key),
    id: field("Message id", id),
    begin: field("From (UTC)", begin),
    end: field("To (UTC)", end),
    limit: field("At most", limit),
  };
  const shown = { key: ["topic", "key"], id: ["id"], time: ["topic", "begin", "end", "limit"] };
  const sync = () => {
    for (const [name, el] of Object.entries(fields)) el.hidden = !shown[by.value].includes(name);
  };
  by.addEventListener("change", sync);
  sync();
  const submit = h("button", { type: "submit", testid: "search-submit" }, "Search");
  const form = h(
    "form",
    { class: "card", testid: "search-form", "aria-label": "Search messages" },
    h("h2", {}, "Find messages"),
    h("div", { class: "row" }, field("Search by", by), Object.values(fields)),
    h("div", { class: "actions" }, submit),
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    await ctx.act(submit, async () => {
      let found;
      if (by.value === "id") {
        if (!id.value.trim()) throw new Error("message id: enter the id to look up");
        found = [await api("GET", `/messages/${seg(id.value.trim())}`)];
      } else {
        if (!topic.value.trim()) throw new Error("topic: enter the topic to search in");
        const q = new URLSearchParams({ topic: topic.value.trim() });
        if (by.value === "key") {
          if (!key.value.trim()) throw new Error("key: enter the key to look up");
          q.set("key", key.value.trim());
        } else {
          const b = utcInput(begin.value);
          const e = utcInput(end.value);
          q.set("begin_ms", String(b ?? Date.now() - 3600_000));
          q.set("end_ms", String(e ?? Date.now()));
          q.set("limit", limit.value || "50");
        }
        found = await api("GET", `/messages?${q}`);
      }
      showResults(results, found);
    });
  });
  return form;
}

function showResults(el, found) {
  fill(
    el,
    h("p", { testid: "search-count", role: "status" }, `${found.length} found`),
    table(
      [
        ["Id", (m) => h("a", { href: messagePage(m.id, m), testid: "message-link" }, m.id), "25%"],
        ["Topic", (m) => cut(m.topic)],
        ["Queue", (m) => cut(`${show(m.broker)}/${show(m.queue_id)} @ ${show(m.queue_offset)}`), "11%"],
        ["Tag", (m) => cut(m.tags), "8%"],
        ["Keys", (m) => cut(keysOf(m), "message-row-keys")],
        ["Stored", (m) => time(m.store_ms), "14%"],
        ["Body", (m) => h("code", {}, cut(m.body ? m.body.preview.slice(0, 200) : "", "message-row-body"))],
      ],
      found,
      { testid: "search-results", rowAttrs: (m) => ({ "data-testid": "message-row", "data-id": m.id }), empty: "No message matches." },
    ),
  );
}

async function overview(ctx) {
  const results = h("div", { testid: "search-output" });
  put(ctx.main, 
    h("h1", {}, "Messages"),
    ctx.admin ? sendForm(ctx) : null,
    searchForm(ctx, results),
    h("section", {}, results),
  );
}

async function detail(ctx, id) {
  put(ctx.main, 
    h("p", { class: "crumbs" }, h("a", { href: ui("messages") }, "Messages"), " / "),
    h("h1", {}, "Message ", h("code", { testid: "message-id" }, id)),
  );
  const m = await api("GET", `/messages/${seg(id)}${copyQuery(ctx.params)}`);
  if (!ctx.live) return;
  const props = Object.entries(m.properties || {}).sort(([a], [b]) => a.localeCompare(b));
  put(ctx.main, 
    copiesNote(m),
    h(
      "dl",
      { class: "facts", testid: "message-facts" },
      h("dt", {}, "Topic"), h("dd", { testid: "message-topic" }, h("a", { href: ui("topics", { name: m.topic }) }, m.topic)),
      h("dt", {}, "Queue"), h("dd", {}, `${show(m.broker)} / queue ${show(m.queue_id)}, offset ${show(m.queue_offset)}`),
      h("dt", {}, "Tag"), h("dd", { testid: "message-tags" }, long(m.tags, { testid: "message-tags" })),
      h("dt", {}, "Keys"), h("dd", { testid: "message-keys" }, long(keysOf(m), { testid: "message-keys" })),
      h("dt", {}, "Born"), h("dd", {}, time(m.born_ms)),
      h("dt", {}, "Stored"), h("dd", {}, time(m.store_ms)),
      h("dt", {}, "Retries"), h("dd", {}, show(m.reconsume_times)),
      h("dt", {}, "Trace id"), h("dd", { testid: "message-trace-id" }, m.trace_id ? h("code", {}, m.trace_id) : "none"),
    ),
    h(
      "section",
      {},
      h("h2", {}, "Body"),
      m.body_error ? h("p", { class: "warning", testid: "message-body-error" }, m.body_error) : null,
      bodyView(m.body),
    ),
    h(
      "section",
      {},
      h("h2", {}, "Properties"),
      table(
        [
          ["Name", ([k]) => h("code", {}, long(k)), "30%"],
          ["Value", ([, v]) => h("code", { class: "wrap" }, long(String(v)))],
        ],
        props,
        { testid: "message-properties", rowAttrs: ([k]) => ({ "data-testid": "property-row", "data-name": k }), empty: "No properties." },
      ),
    ),
  );
}
