// Transactions: pending half messages (filter by producer group / topic), commit or roll back.

import { api, seg } from "../api.js";
import { cut, field, fill, h, put, show, table, time, ui } from "../dom.js";

export const title = "Transactions";

export async function render(ctx) {
  const group = h("input", { testid: "txn-group", autocomplete: "off", value: ctx.params.get("group") || "" });
  const topic = h("input", { testid: "txn-topic", autocomplete: "off", value: ctx.params.get("topic") || "" });
  const apply = h("button", { type: "submit", testid: "txn-filter" }, "Filter");
  const filter = h(
    "form",
    { class: "row", "aria-label": "Filter pending transactions" },
    field("Producer group", group),
    field("Topic", topic),
    h("div", { class: "actions" }, apply),
  );
  filter.addEventListener("submit", (event) => {
    event.preventDefault();
    const q = {};
    if (group.value.trim()) q.group = group.value.trim();
    if (topic.value.trim()) q.topic = topic.value.trim();
    ctx.navigate(ui("transactions", Object.keys(q).length ? q : undefined));
  });
  const list = h("div", { testid: "txn-list" });
  const note = h("p", { role: "status", testid: "txn-result" });
  put(ctx.main, 
    h("h1", {}, "Pending transactions"),
    h("p", { class: "muted" }, "Half messages whose producer has neither committed nor rolled back yet; the checker asks their producers again."),
    filter,
    note,
    list,
  );
  const refresh = async () => {
    const q = new URLSearchParams();
    if (ctx.params.get("group")) q.set("group", ctx.params.get("group"));
    if (ctx.params.get("topic")) q.set("topic", ctx.params.get("topic"));
    const pending = await api("GET", `/transactions${q.toString() ? `?${q}` : ""}`);
    if (!ctx.live) return;
    const resolve = (t, commit) => async (event) => {
      await ctx.act(event.currentTarget, async () => {
        await api("POST", `/transactions/${seg(t.id)}/resolve`, { commit });
        fill(note, `${commit ? "Committed" : "Rolled back"} ${t.id}.`);
        await refresh();
      });
    };
    const columns = [
      ["Id", (t) => h("code", {}, t.id), "20%"],
      ["Topic", (t) => show(t.topic)],
      ["Producer group", (t) => show(t.producer_group ?? t.group)],
      ["Keys", (t) => cut(Array.isArray(t.keys) ? t.keys.join(" ") : t.keys)],
      ["First stored", (t) => time(t.first_stored_ms ?? t.store_ms), "12%"],
      ["Checks", (t) => `${show(t.check_times)}${t.checking ? " (being checked)" : ""}`, "9%"],
      ["Broker", (t) => show(t.broker), "10%"],
    ];
    if (ctx.admin) {
      columns.push([
        "Resolve",
        (t) =>
          h(
            "span",
            { class: "actions tight" },
            h("button", { type: "button", testid: "txn-commit", onclick: resolve(t, true) }, "Commit"),
            h("button", { type: "button", class: "danger", testid: "txn-rollback", onclick: resolve(t, false) }, "Roll back"),
          ),
        "13rem", // the two buttons side by side
      ]);
    }
    fill(
      list,
      table(columns, pending, {
        testid: "txn-table",
        rowAttrs: (t) => ({ "data-testid": "txn-row", "data-id": t.id }),
        empty: "No pending transactions.",
      }),
    );
  };
  ctx.every(5000, refresh);
}
