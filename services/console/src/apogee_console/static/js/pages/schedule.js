// Schedule: delayed messages waiting per delay level, now and over time.

import { api } from "../api.js";
import { barChart, lineChart, liveChart } from "../chart.js";
import { fill, h, num, put, table } from "../dom.js";

export const title = "Schedule";

/** The total over all levels, and each level that had a backlog (a line per idle level says nothing). */
function busyLevels(data) {
  const series = (data && data.series) || [];
  const total = new Map();
  for (const x of series) for (const [t, v] of x.points) total.set(t, (total.get(t) || 0) + (v || 0));
  const busy = series
    .filter((x) => x.points.some(([, v]) => v > 0))
    .map((x) => ({ ...x, label: /^\d+$/.test(String(x.label)) ? `level ${x.label}` : x.label }));
  const points = [...total.entries()].sort(([a], [b]) => a - b);
  return { ...data, series: [{ label: "all levels", points }, ...(busy.length > 1 ? busy : [])] };
}

export async function render(ctx) {
  const now = h("div", { testid: "schedule-now" });
  const levels = h("div", { testid: "schedule-levels" });
  const history = h("div", { testid: "schedule-backlog-chart" });
  put(ctx.main, 
    h("h1", {}, "Scheduled messages"),
    h("p", { class: "muted" }, "Delayed messages and retries wait in the schedule topic until their delay level is due."),
    h("section", {}, h("h2", {}, "Backlog per delay level"), now),
    h("section", {}, h("h2", {}, "Backlog over time"), history),
    h("section", {}, h("h2", {}, "Levels"), levels),
  );
  ctx.every(5000, async () => {
    const backlog = await api("GET", "/schedule");
    if (!ctx.live) return;
    const total = backlog.reduce((n, l) => n + (l.backlog || 0), 0);
    fill(
      now,
      h("p", { testid: "schedule-total" }, `${num(total)} messages waiting`),
      barChart(
        backlog.map((l) => ({ label: l.delay, value: l.backlog })),
        { title: "Messages waiting per delay level", unit: "msgs", testid: "schedule-bar-svg" },
      ),
    );
    fill(
      levels,
      table(
        [
          ["Level", (l) => l.level],
          ["Delay", (l) => l.delay],
          ["Waiting", (l) => num(l.backlog)],
        ],
        backlog,
        { testid: "schedule-table", rowAttrs: () => ({ "data-testid": "schedule-row" }) },
      ),
    );
  });
  ctx.onDispose(
    liveChart(
      history,
      () => api("GET", "/metrics/schedule/backlog?minutes=15"),
      (data) => lineChart(busyLevels(data), { title: "Messages waiting, last 15 minutes", unit: "msgs", testid: "schedule-line-svg" }),
      5000,
    ),
  );
}
