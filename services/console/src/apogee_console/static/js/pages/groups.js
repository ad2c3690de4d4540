// Groups: the list; ?name=G shows members, lag per queue, a lag chart and the offset reset.
// A group that official RocketMQ 5 clients consume by POP also shows its connected clients
// (language, version, type) and, per queue, the messages in flight and still invisible.

import { api, seg } from "../api.js";
import { lineChart, liveChart } from "../chart.js";
import { cut, field, fill, h, long, num, put, show, table, ui, utcInput } from "../dom.js";

export const title = "Groups";

export async function render(ctx) {
  const name = ctx.params.get("name");
  if (name) return detail(ctx, name);
  return list(ctx);
}

async function list(ctx) {
  const body = h("div", { testid: "groups-list" });
  put(ctx.main, h("h1", {}, "Consumer groups"), body);
  ctx.every(5000, async () => {
    const groups = await api("GET", "/groups");
    if (!ctx.live) return;
    groups.sort((a, b) => a.name.localeCompare(b.name));
    fill(
      body,
      table(
        [
          ["Group", (g) => h("a", { href: ui("groups", { name: g.name }), testid: "group-link" }, g.name)],
          ["Members", (g) => num(Array.isArray(g.members) ? g.members.length : g.members), "10%"],
          ["Topics", (g) => (Array.isArray(g.topics) ? g.topics.join(", ") : show(g.topics)), "40%"],
          ["Lag (messages)", (g) => num(g.lag_messages), "14%"],
        ],
        groups,
        { testid: "groups-table", rowAttrs: (g) => ({ "data-testid": "group-row", "data-name": g.name }), empty: "No consumer groups." },
      ),
    );
  });
}

function member(m) {
  if (typeof m === "string") return m;
  return m.client_id || m.id || m.name || JSON.stringify(m);
}

function resetForm(ctx, name, topicsOf, refresh) {
  const topic = h("select", { testid: "reset-topic", required: true });
  const to = h(
    "select",
    { testid: "reset-to" },
    h("option", { value: "earliest" }, "earliest (replay everything kept)"),
    h("option", { value: "latest" }, "latest (skip the backlog)"),
    h("option", { value: "timestamp" }, "a time"),
  );
  const when = h("input", { testid: "reset-timestamp", type: "datetime-local", step: 1 });
  const whenField = field("Time (UTC)", when);
  whenField.hidden = true;
  to.addEventListener("change", () => {
    whenField.hidden = to.value !== "timestamp";
  });
  const dry = h("button", { type: "button", testid: "reset-dry-run" }, "Dry run");
  const apply = h("button", { type: "button", class: "danger", testid: "reset-apply" }, "Reset offsets");
  const result = h("div", { testid: "reset-result", role: "status" });
  const syncTopics = () => {
    const have = new Set([...topic.options].map((o) => o.value));
    for (const t of topicsOf()) if (!have.has(t)) topic.append(h("option", { value: t }, t));
  };
  const run = (button, dryRun) =>
    ctx.act(button, async () => {
      const body = { topic: topic.value, to: to.value, dry_run: dryRun };
      if (to.value === "timestamp") {
        const ms = utcInput(when.value);
        if (ms === null) throw new Error("time: pick the time to reset to");
        body.timestamp_ms = ms;
      }
      const answer = await api("POST", `/groups/${seg(name)}/reset`, body);
      const rows = Array.isArray(answer) ? answer : answer.queues || [];
      const moved = rows.reduce((n, r) => n + (r.to - r.from), 0);
      fill(
        result,
        h(
          "p",
          { testid: "reset-summary" },
          dryRun ? "Dry run, nothing changed: " : "Reset done: ",
          `${rows.length} queues, the group would ${moved < 0 ? "consume again" : "skip"} ${num(Math.abs(moved))} messages.`.replace(
            "would",
            dryRun ? "would" : "will",
          ),
        ),
        table(
          [
            ["Broker", (r) => r.broker],
            ["Queue", (r) => r.queue_id, "10%"],
            ["From offset", (r) => num(r.from)],
            ["To offset", (r) => num(r.to)],
            ["Effect", (r) => (r.to === r.from ? "unchanged" : r.to < r.from ? `${num(r.from - r.to)} again` : `${num(r.to - r.from)} skipped`)],
          ],
          rows,
          { testid: "reset-table", rowAttrs: () => ({ "data-testid": "reset-row" }) },
        ),
      );
      if (!dryRun) await refresh();
    });
  dry.addEventListener("click", () => run(dry, true));
  apply.addEventListener("click", () => run(apply, false));
  const form = h(
    "form",
    { class: "card", testid: "reset-form", "aria-label": "Reset the group's offsets" },
    h("h2", {}, "Reset offsets"),
    h("p", { class: "muted" }, "Try a dry run first: it shows each queue's offset now and where it would go."),
    h("div", { class: "row" }, field("Topic", topic), field("To", to), whenField),
    h("div", { class: "actions" }, dry, apply),
    result,
  );
  form.addEventListener("submit", (event) => event.preventDefault());
  return { form, syncTopics };
}

async function detail(ctx, name) {
  const facts = h("dl", { class: "facts", testid: "group-facts" });
  const warnings = h("div", { testid: "group-warnings" });
  const queues = h("div", { testid: "group-queues" });
  const clients = h("div", { testid: "group-clients" });
  const clientsSection = h("section", { testid: "group-clients-section" }, h("h2", {}, "Connected RocketMQ 5 clients"), clients);
  clientsSection.hidden = true;
  const chart = h("div", { testid: "group-lag-chart" });
  let topics = [];
  const reset = ctx.admin ? resetForm(ctx, name, () => topics, () => refresh()) : null;
  put(ctx.main, 
    h("p", { class: "crumbs" }, h("a", { href: ui("groups") }, "Groups"), " / "),
    h("h1", { testid: "group-name" }, name),
    facts,
    warnings,
    clientsSection,
    h("section", {}, h("h2", {}, "Lag over time"), chart),
    h("section", {}, h("h2", {}, "Queues"), queues),
    reset ? reset.form : null,
    h("p", {}, h("a", { href: ui("dlq", { group: name }) }, "Dead letters of this group")),
  );
  const refresh = async () => {
    const g = await api("GET", `/groups/${seg(name)}`);
    if (!ctx.live) return;
    topics = [...new Set(g.queues.map((q) => q.topic).filter((t) => !t.startsWith("%RETRY%")))].sort();
    const pop = g.consumption === "POP";
    const clientRows = g.clients || [];
    const inFlight = pop || g.queues.some((q) => q.in_flight > 0);
    fill(
      facts,
      h("dt", {}, "Consumption"),
      h(
        "dd",
        { testid: "group-consumption" },
        pop ? "POP (official RocketMQ 5 clients)" : g.consumption === "OFFSETS" ? "OFFSETS (queue offsets)" : "not known yet",
      ),
      pop && !g.members.length
        ? [
            h("dt", {}, "Clients"),
            h("dd", { testid: "group-client-count" }, `${num(new Set(clientRows.map((c) => c.client_id)).size)} connected`),
          ]
        : [
            h("dt", {}, "Members"),
            h("dd", { testid: "group-members" }, g.members.length ? g.members.map(member).join(", ") : "none connected"),
          ],
      h("dt", {}, "Lag"),
      h("dd", {}, h("span", { testid: "group-lag-messages" }, num(g.lag_messages)), " messages"),
      h("dt", {}, "Oldest waiting"),
      h("dd", {}, h("span", { testid: "group-lag-seconds" }, num(g.lag_seconds, 1)), " s"),
      inFlight
        ? [
            h("dt", {}, "In flight"),
            h(
              "dd",
              {},
              h("span", { testid: "group-in-flight" }, num(g.in_flight)),
              " messages, ",
              h("span", { testid: "group-invisible" }, num(g.invisible)),
              " still invisible",
            ),
          ]
        : null,
    );
    clientsSection.hidden = !pop && clientRows.length === 0;
    fill(
      clients,
      table(
        [
          ["Client id", (c) => cut(c.client_id)],
          ["Language", (c) => show(c.language), "11%"],
          ["Version", (c) => show(c.version), "10%"],
          ["Type", (c) => show(c.client_type), "16%"],
          ["Host", (c) => cut(c.host), "16%"],
          ["Broker", (c) => c.broker, "12%"],
        ],
        clientRows,
        {
          testid: "group-client-table",
          rowAttrs: (c) => ({ "data-testid": "group-client-row", "data-client": c.client_id, "data-broker": c.broker }),
          empty: "No official client is connected.",
        },
      ),
    );
    fill(
      warnings,
      (g.warnings || []).map((w) => h("p", { class: "warning", testid: "group-warning" }, long(typeof w === "string" ? w : JSON.stringify(w)))),
    );
    fill(
      queues,
      table(
        [
          ["Topic", (q) => q.topic],
          ["Broker", (q) => q.broker, "15%"],
          ["Queue", (q) => q.queue_id, "7%"],
          ["Broker offset", (q) => num(q.broker_offset), "12%"],
          ["Consumer offset", (q) => num(q.consumer_offset), "12%"],
          ["Lag (messages)", (q) => num(q.lag_messages), "11%"],
          ["Lag (s)", (q) => num(q.lag_seconds, 1), "8%"],
          ...(inFlight
            ? [
                ["In flight", (q) => num(q.in_flight), "8%"],
                ["Invisible", (q) => num(q.invisible), "8%"],
              ]
            : []),
        ],
        g.queues,
        { testid: "group-queue-table", rowAttrs: () => ({ "data-testid": "group-queue-row" }), empty: pop ? "The group has received no message yet." : "The group has no offsets yet." },
      ),
    );
    if (reset) reset.syncTopics();
  };
  ctx.every(3000, refresh);
  ctx.onDispose(
    liveChart(
      chart,
      () => api("GET", `/metrics/groups/${seg(name)}/lag?minutes=15`),
      (data) => lineChart(data, { title: `Lag of ${name}, last 15 minutes`, unit: "msgs", testid: "group-lag-svg" }),
      5000,
    ),
  );
}
