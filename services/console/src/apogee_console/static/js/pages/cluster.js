// Cluster: nameservers and brokers, with each broker's version and last recovery.

import { api } from "../api.js";
import { fill, h, okBadge, put, show, table } from "../dom.js";

export const title = "Cluster";

function recovery(r) {
  if (!r) return "—";
  if (typeof r.summary === "string") {
    return h("span", { class: "small", title: JSON.stringify(r, null, 1) }, r.summary);
  }
  const parts = Object.entries(r).map(([k, v]) => `${k.replaceAll("_", " ")}: ${typeof v === "object" ? JSON.stringify(v) : v}`);
  return h("span", { class: "small" }, parts.join("; "));
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
          ["Last recovery", (b) => recovery(b.recovery)],
        ],
        c.brokers,
        { testid: "broker-table", rowAttrs: (b) => ({ "data-testid": "broker-row", "data-name": b.name }), empty: "No broker is registered." },
      ),
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
