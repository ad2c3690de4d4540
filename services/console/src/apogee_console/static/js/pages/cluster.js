// Cluster: nameservers and brokers, with each broker's version, last recovery and replica group.

import { api } from "../api.js";
import { fill, h, num, okBadge, put, show, table } from "../dom.js";

export const title = "Cluster";

function recovery(r) {
  if (!r) return "—";
  if (typeof r.summary === "string") {
    return h("span", { class: "small", title: JSON.stringify(r, null, 1) }, r.summary);
  }
  const parts = Object.entries(r).map(([k, v]) => `${k.replaceAll("_", " ")}: ${typeof v === "object" ? JSON.stringify(v) : v}`);
  return h("span", { class: "small" }, parts.join("; "));
}

/** A broker's replica group in one line: its leader, epoch and "in sync N/M". */
export function replication(g) {
  if (!g) return "—";
  if (!g.replicated) return h("span", { class: "muted" }, "lone broker");
  return h(
    "span",
    { testid: "replication-summary" },
    `leader ${show(g.leader_id)}, epoch ${g.epoch}, in sync ${g.in_sync_count}/${g.replica_count}`,
  );
}

const yesNo = (v) => (v ? "yes" : "no");

/** The replicas of every replica group in `brokers` (the rows of GET /cluster), a table each. */
export function replicaGroups(brokers) {
  const groups = brokers.map((b) => b.replication).filter((g) => g && g.replicated);
  return groups.map((g) =>
    h(
      "div",
      { testid: "replica-group", "data-name": g.name },
      table(
        [
          ["Replica", (r) => h("code", {}, show(r.id))],
          ["Address", (r) => h("code", {}, show(r.address)), "16%"],
          ["Role", (r) => show(r.role), "11%"],
          ["In sync", (r) => yesNo(r.in_sync), "8%"],
          ["Lag (bytes)", (r) => num(r.lag_bytes), "11%"],
          ["Lag (s)", (r) => num(r.lag_seconds, 1), "8%"],
          ["May lead", (r) => yesNo(r.eligible), "9%"],
          ["State", (r) => (r.reachable ? okBadge(true) : h("span", { title: show(r.error) }, okBadge(false))), "8%"],
        ],
        g.replicas,
        {
          testid: "replica-table",
          caption: `Replica group ${g.name}: leader ${show(g.leader_id)}, epoch ${g.epoch}, acks ${show(g.acks)}, in sync ${g.in_sync_count}/${g.replica_count} (at least ${g.min_insync_replicas}), high watermark ${num(g.high_watermark)}`,
          rowAttrs: (r) => ({ "data-testid": "replica-row", "data-id": r.id }),
        },
      ),
    ),
  );
}

export async function render(ctx) {
  const nameservers = h("div", { testid: "cluster-nameservers" });
  const brokers = h("div", { testid: "cluster-brokers" });
  const summary = h("p", { testid: "cluster-summary", role: "status" });
  put(ctx.main, 
    h("h1", {}, "Cluster"),
    summary,
    h("section", {}, h("h2", {}, "Brokers"), brokers),
    h("section", {}, h("h2", {}, "Nameservers"), nameservers),
  );
  ctx.every(5000, async () => {
    const c = await api("GET", "/cluster");
    if (!ctx.live) return;
    const up = c.brokers.filter((b) => b.ok).length;
    fill(
      summary,
      `${up} of ${c.brokers.length} brokers up, ${c.nameservers.filter((n) => n.ok).length} of ${c.nameservers.length} nameservers answering; cluster authentication ${c.auth ? "on" : "off"}.`,
    );
    fill(
      brokers,
      table(
        [
          ["Broker", (b) => b.name],
          ["Cluster", (b) => show(b.cluster)],
          ["Address", (b) => h("code", {}, show(b.address)), "16%"],
          ["State", (b) => okBadge(b.ok), "8%"],
          ["Version", (b) => show(b.version), "10%"],
          ["Replication", (b) => replication(b.replication), "18%"],
          ["Last recovery", (b) => recovery(b.recovery)],
        ],
        c.brokers,
        { testid: "broker-table", rowAttrs: (b) => ({ "data-testid": "broker-row", "data-name": b.name }), empty: "No broker is registered." },
      ),
      replicaGroups(c.brokers),
    );
    fill(
      nameservers,
      table(
        [
          ["Address", (n) => h("code", {}, n.address)],
          ["State", (n) => okBadge(n.ok), "20%"],
        ],
        c.nameservers,
        { testid: "nameserver-table", rowAttrs: () => ({ "data-testid": "nameserver-row" }) },
      ),
    );
  });
}
