// Dead letters: ?group=G lists the group's dead letters (reason, attempts) and redrives them.

import { api, seg } from "../api.js";
import { cut, field, fill, h, long, messagePage, num, put, show, table, time, ui, utcInput } from "../dom.js";

export const title = "Dead letters";

function pickGroup(ctx, current) {
  const input = h("input", { testid: "dlq-group", list: "dlq-groups", autocomplete: "off", required: true, value: current || "" });
  const options = h("datalist", { id: "dlq-groups" });
  api("GET", "/groups")
    .then((groups) => fill(options, groups.map((g) => h("option", { value: g.name }))))
    .catch(() => {});
  const go = h("button", { type: "submit", testid: "dlq-show" }, "Show");
  const form = h(
    "form",
    { class: "row", testid: "dlq-group-form", "aria-label": "Choose a group" },
    field("Group", input),
    options,
    h("div", { class: "actions" }, go),
  );
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    if (input.value.trim()) ctx.navigate(ui("dlq", { group: input.value.trim() }));
  });
  return form;
}

function plural(n) {
  return n === 1 ? "dead letter" : "dead letters";
}

function redriveForm(ctx, group, refresh) {
  const key = h("input", { testid: "redrive-key", autocomplete: "off" });
  const tag = h("input", { testid: "redrive-tag", autocomplete: "off" });
  const topic = h("input", { testid: "redrive-topic", autocomplete: "off" });
  const since = h("input", { testid: "redrive-since", type: "datetime-local", step: 1 });
  const dry = h("button", { type: "button", testid: "redrive-dry-run" }, "Dry run");
  const go = h("button", { type: "button", class: "danger", testid: "redrive-submit" }, "Redrive");
  const result = h("div", { testid: "redrive-result", role: "status" });
  const run = (button, dryRun) =>
    ctx.act(button, async () => {
      const body = { dry_run: dryRun };
      if (key.value.trim()) body.key = key.value.trim();
      if (tag.value.trim()) body.tag = tag.value.trim();
      if (topic.value.trim()) body.topic = topic.value.trim();
      const ms = utcInput(since.value);
      if (ms !== null) body.since_ms = ms;
      const r = await api("POST", `/dlq/${seg(group)}/redrive`, body);
      const count = r.redriven ?? r.matched ?? 0;
      const extra = Object.entries(r)
        .filter(([k, v]) => !["redriven", "dry_run"].includes(k) && typeof v !== "object")
        .map(([k, v]) => `${k.replaceAll("_", " ")} ${v}`);
      fill(
        result,
        h(
          "p",
          { testid: "redrive-summary" },
          dryRun
            ? `Dry run: ${num(r.matched ?? count)} ${plural(r.matched ?? count)} match; nothing was sent.`
            : `Redriven: ${num(count)} ${plural(count)} sent to ${count === 1 ? "its topic" : "their topics"} again.`,
          extra.length ? ` (${extra.join(", ")})` : "",
        ),
      );
      if (!dryRun) await refresh();
    });
  dry.addEventListener("click", () => run(dry, true));
  go.addEventListener("click", () => run(go, false));
  const form = h(
    "form",
    { class: "card", testid: "redrive-form", "aria-label": "Redrive dead letters" },
    h("h2", {}, "Redrive"),
    h("p", { class: "muted" }, "Sends each matching dead letter to its original topic again; empty filters match all. The dead letters stay where they are."),
    h("div", { class: "row" }, field("Key", key), field("Tag", tag), field("Original topic", topic), field("Since (UTC)", since)),
    h("div", { class: "actions" }, dry, go),
    result,
  );
  form.addEventListener("submit", (event) => event.preventDefault());
  return form;
}

export async function render(ctx) {
  const group = ctx.params.get("group");
  put(ctx.main, h("h1", {}, "Dead letters"), pickGroup(ctx, group));
  if (!group) {
    put(ctx.main, h("p", { class: "muted" }, "Choose a consumer group to see its dead letters."));
    return;
  }
  const entries = h("div", { testid: "dlq-entries" });
  const refresh = async () => {
    const list = await api("GET", `/dlq/${seg(group)}`);
    if (!ctx.live) return;
    fill(
      entries,
      h("p", { testid: "dlq-count", role: "status" }, `${list.length} dead letter${list.length === 1 ? "" : "s"} of ${group}`),
      table(
        [
          // the dead letter is the copy in the group's dead-letter topic; its page links the original
          ["Id", (d) => h("a", { href: messagePage(d.id, { ...d, topic: `%DLQ%${group}` }), testid: "dlq-link" }, h("code", {}, d.id)), "25%"],
          ["Original topic", (d) => show(d.origin_topic)],
          ["Reason", (d) => h("span", { class: "wrap", testid: "dlq-reason" }, long(d.reason))],
          ["Attempts", (d) => h("span", { testid: "dlq-attempts" }, num(d.attempts)), "10%"],
          ["Dead since", (d) => time(d.store_ms), "12%"],
          ["Body", (d) => h("code", {}, cut(d.body ? d.body.preview.slice(0, 200) : ""))],
        ],
        list,
        { testid: "dlq-table", rowAttrs: (d) => ({ "data-testid": "dlq-row", "data-id": d.id }), empty: "No dead letters." },
      ),
    );
  };
  put(ctx.main, 
    h("section", {}, h("h2", {}, `Dead letters of ${group}`), entries),
    ctx.admin ? redriveForm(ctx, group, refresh) : null,
  );
  ctx.every(5000, refresh);
}
