// Topics: the list with a create form; ?name=T shows one topic's queues, rate chart and settings.

import { api, seg } from "../api.js";
import { lineChart, liveChart } from "../chart.js";
import { field, fill, h, num, put, show, table, time, ui } from "../dom.js";

export const title = "Topics";

export async function render(ctx) {
  const name = ctx.params.get("name");
  if (name) return detail(ctx, name);
  return list(ctx);
}

// A topic's message type: the messages it accepts (RocketMQ 5's topic message types).
const TYPES = [
  ["MIXED", "MIXED: every type"],
  ["NORMAL", "NORMAL: plain messages"],
  ["FIFO", "FIFO: messages with a message group"],
  ["DELAY", "DELAY: delayed and timer messages"],
  ["TRANSACTION", "TRANSACTION: transactional messages"],
];

function typeSelect(testid, options, current) {
  return h(
    "select",
    { testid, name: "message_type" },
    options.map(([value, label]) => h("option", { value, selected: value === current }, label)),
  );
}

function createForm(ctx, refresh) {
  const name = h("input", { testid: "topic-create-name", name: "name", required: true, autocomplete: "off" });
  const queues = h("input", { testid: "topic-create-queues", name: "queues", type: "number", min: 1, max: 1024, value: "8", required: true });
  const type = typeSelect("topic-create-type", TYPES, "MIXED");
  const submit = h("button", { type: "submit", testid: "topic-create-submit" }, "Create topic");
  const done = h("p", { testid: "topic-create-result", role: "status" });
  const form = h(
    "form",
    { class: "card inline", testid: "topic-create-form", "aria-label": "Create a topic" },
    h("h2", {}, "Create a topic"),
    h("div", { class: "row" }, field("Name", name), field("Queues per broker", queues), field("Message type", type), h("div", { class: "actions" }, submit)),
    done,
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    await ctx.act(submit, async () => {
      fill(done);
      const topic = name.value.trim();
      await api("POST", "/topics", { name: topic, queues: Number(queues.value), message_type: type.value });
      fill(done, "Created ", h("a", { href: ui("topics", { name: topic }), testid: "topic-created-link" }, topic), ".");
      name.value = "";
      await refresh();
    });
  });
  return form;
}

async function list(ctx) {
  const body = h("div", { testid: "topics-list" });
  const filter = h("input", { testid: "topics-filter", type: "search", placeholder: "filter by name", "aria-label": "Filter topics by name" });
  let last = [];
  const draw = () => {
    const needle = filter.value.trim().toLowerCase();
    const rows = last.filter((t) => !needle || t.name.toLowerCase().includes(needle));
    fill(
      body,
      table(
        [
          ["Topic", (t) => h("a", { href: ui("topics", { name: t.name }), testid: "topic-link" }, t.name)],
          ["Type", (t) => show(t.message_type), "12%"],
          ["Queues", (t) => num(t.queues), "9%"],
          ["Brokers", (t) => (t.brokers || []).join(", "), "22%"],
          ["Messages", (t) => num(t.messages), "12%"],
          ["Rate (msg/s)", (t) => num(t.rate_per_s, 2), "12%"],
        ],
        rows,
        { testid: "topics-table", rowAttrs: (t) => ({ "data-testid": "topic-row", "data-name": t.name }), empty: "No topics." },
      ),
    );
  };
  const refresh = async () => {
    const topics = await api("GET", "/topics");
    if (!ctx.live) return;
    last = topics.slice().sort((a, b) => a.name.localeCompare(b.name));
    draw();
  };
  filter.addEventListener("input", draw);
  put(ctx.main, 
    h("h1", {}, "Topics"),
    ctx.admin ? createForm(ctx, refresh) : null,
    h("section", {}, h("div", { class: "row spread" }, h("h2", {}, "All topics"), filter), body),
  );
  ctx.every(5000, refresh);
}

const PERMS = [
  ["rw", "read and write"],
  ["r", "read only"],
  ["w", "write only"],
  ["none", "none"],
];

/** The API's perm text ("RW-", "R--", as RocketMQ prints it) as the value PUT takes ("rw", "r"). */
function permKey(text) {
  if (typeof text !== "string" || text.length < 2) return "rw";
  const read = text[0] === "R";
  const write = text[1] === "W";
  return read && write ? "rw" : read ? "r" : write ? "w" : "none";
}

function settingsForm(ctx, name, current, refresh) {
  const queues = h("input", { testid: "topic-update-queues", type: "number", min: 1, max: 1024, value: String(current.queues) });
  const perm = h(
    "select",
    { testid: "topic-update-perm" },
    PERMS.map(([value, label]) => h("option", { value, selected: value === permKey(current.perm) }, label)),
  );
  // "" keeps each broker's type (the PUT leaves message_type out)
  const type = typeSelect("topic-update-type", [["", `unchanged (${show(current.message_type)})`], ...TYPES], "");
  const save = h("button", { type: "submit", testid: "topic-update-submit" }, "Save");
  const result = h("p", { role: "status", testid: "topic-update-result" });
  const form = h(
    "form",
    { class: "card", "aria-label": "Change the topic", testid: "topic-update-form" },
    h("h2", {}, "Change"),
    h("div", { class: "row" }, field("Queues per broker", queues), field("Permission", perm), field("Message type", type), h("div", { class: "actions" }, save)),
    result,
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    await ctx.act(save, async () => {
      const change = { queues: Number(queues.value), perm: perm.value };
      if (type.value) change.message_type = type.value;
      await api("PUT", `/topics/${seg(name)}`, change);
      fill(result, "Saved.");
      await refresh();
    });
  });
  const confirm = h("input", { testid: "topic-delete-confirm", autocomplete: "off" });
  const del = h("button", { type: "submit", class: "danger", testid: "topic-delete-submit" }, "Delete topic");
  const delForm = h(
    "form",
    { class: "card", "aria-label": "Delete the topic", testid: "topic-delete-form" },
    h("h2", {}, "Delete"),
    h("p", {}, "Deleting a topic removes its routes and its messages on every broker."),
    h("div", { class: "row" }, field(`Type the topic's name (${name}) to confirm`, confirm), h("div", { class: "actions" }, del)),
  );
  delForm.addEventListener("submit", async (event) => {
    event.preventDefault();
    if (confirm.value !== name) {
      ctx.error(`type the topic's name "${name}" to confirm its deletion`);
      return;
    }
    await ctx.act(del, async () => {
      await api("DELETE", `/topics/${seg(name)}`);
      ctx.navigate(ui("topics"));
    });
  });
  return h("section", { class: "grid2" }, form, delForm);
}

async function detail(ctx, name) {
  const info = h("dl", { class: "facts", testid: "topic-facts" });
  const queues = h("div", { testid: "topic-queues" });
  const chart = h("div", { testid: "topic-rate-chart" });
  const admin = h("div");
  put(ctx.main, 
    h("p", { class: "crumbs" }, h("a", { href: ui("topics") }, "Topics"), " / "),
    h("h1", { testid: "topic-name" }, name),
    info,
    h("section", {}, h("h2", {}, "Message rate"), chart),
    h("section", {}, h("h2", {}, "Queues"), queues),
    admin,
    h("p", {}, h("a", { href: ui("messages", { topic: name }) }, "Send or search messages of this topic")),
  );
  let formShown = false;
  const refresh = async () => {
    const t = await api("GET", `/topics/${seg(name)}`);
    if (!ctx.live) return;
    const total = t.queues.reduce((n, q) => n + (q.max_offset - q.min_offset), 0);
    fill(
      info,
      h("dt", {}, "Queues"), h("dd", { testid: "topic-queue-count" }, num(t.queues.length)),
      h("dt", {}, "Messages kept"), h("dd", { testid: "topic-messages" }, num(total)),
      h("dt", {}, "Rate"), h("dd", { testid: "topic-rate" }, `${num(t.rate_per_s, 2)} msg/s`),
      h("dt", {}, "Permission"), h("dd", { testid: "topic-perm" }, show(t.perm)),
      h("dt", {}, "Message type"), h("dd", { testid: "topic-type" }, show(t.message_type)),
    );
    fill(
      queues,
      table(
        [
          ["Broker", (q) => q.broker],
          ["Queue", (q) => q.queue_id, "10%"],
          ["Min offset", (q) => num(q.min_offset), "16%"],
          ["Max offset", (q) => num(q.max_offset), "16%"],
          ["Last stored", (q) => time(q.last_store_ms), "22%"],
        ],
        t.queues,
        { testid: "topic-queue-table", rowAttrs: () => ({ "data-testid": "topic-queue-row" }) },
      ),
    );
    if (ctx.admin && !formShown) {
      formShown = true;
      const brokers = new Set(t.queues.map((q) => q.broker)).size || 1;
      fill(admin, settingsForm(ctx, name, { queues: Math.round(t.queues.length / brokers), perm: t.perm, message_type: t.message_type }, refresh));
    }
  };
  ctx.every(5000, refresh);
  ctx.onDispose(
    liveChart(
      chart,
      () => api("GET", `/metrics/topics/${seg(name)}/rate?minutes=15`),
      (data) => lineChart(data, { title: `Messages stored per second, ${name}, last 15 minutes`, unit: "msg/s", testid: "topic-rate-svg" }),
      5000,
    ),
  );
}
