// Charts as inline SVG: line charts of /api/v1/metrics series, bar charts of current values.
//
// lineChart({series: [{label, points: [[epoch_s, value], ...]}]}, {title, unit}) -> <figure>
// barChart([{label, value}], {title, unit}) -> <figure>
// liveChart(container, load, options) redraws from `await load()` every few seconds; returns stop().

import { h, num } from "./dom.js";

const SVG = "http://www.w3.org/2000/svg";
const COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];
const WIDTH = 640;
const HEIGHT = 220;
const PAD = { left: 56, right: 12, top: 12, bottom: 28 };

function s(tag, attrs = {}, ...children) {
  const el = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) el.setAttribute(key, String(value));
  for (const child of children) {
    if (child === null || child === undefined) continue;
    el.appendChild(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

/** A "nice" upper bound for an axis: 1, 2 or 5 times a power of ten, at least `max`. */
function niceMax(max) {
  if (!(max > 0)) return 1;
  const power = 10 ** Math.floor(Math.log10(max));
  for (const step of [1, 2, 5, 10]) if (step * power >= max) return step * power;
  return 10 * power;
}

function clock(epochS) {
  return new Date(epochS * 1000).toISOString().slice(11, 19);
}

function frame(title, unit, testid, svg, legend, summary) {
  return h(
    "figure",
    { class: "chart", testid },
    h("figcaption", {}, title, unit ? ` (${unit})` : ""),
    svg,
    legend,
    summary ? h("p", { class: "muted small", testid: testid ? `${testid}-summary` : null }, summary) : null,
  );
}

function axes(yMax, unit, xLabels) {
  const g = s("g", { class: "axes" });
  const innerH = HEIGHT - PAD.top - PAD.bottom;
  for (const fraction of [0, 0.5, 1]) {
    const y = PAD.top + innerH * (1 - fraction);
    g.appendChild(s("line", { x1: PAD.left, x2: WIDTH - PAD.right, y1: y, y2: y, class: "grid" }));
    g.appendChild(
      s("text", { x: PAD.left - 6, y: y + 4, "text-anchor": "end" }, num(yMax * fraction, 2)),
    );
  }
  for (const [x, label, anchor] of xLabels) {
    g.appendChild(s("text", { x, y: HEIGHT - 8, "text-anchor": anchor }, label));
  }
  return g;
}

/** A line chart of metric series (`points` are [epoch seconds, value]). */
export function lineChart(data, { title = "", unit = "", testid = null } = {}) {
  const series = (data && data.series ? data.series : []).filter((x) => x.points && x.points.length);
  const svg = s("svg", {
    viewBox: `0 0 ${WIDTH} ${HEIGHT}`,
    role: "img",
    "aria-label": title,
    preserveAspectRatio: "xMidYMid meet",
  });
  svg.appendChild(s("title", {}, title));
  if (series.length === 0) {
    svg.appendChild(axes(1, unit, []));
    svg.appendChild(
      s("text", { x: WIDTH / 2, y: HEIGHT / 2, "text-anchor": "middle", class: "nodata" }, "no data yet"),
    );
    return frame(title, unit, testid, svg, null, "No samples yet; the chart fills in as the console samples.");
  }
  let t0 = Infinity;
  let t1 = -Infinity;
  let max = 0;
  for (const x of series) {
    for (const [t, v] of x.points) {
      t0 = Math.min(t0, t);
      t1 = Math.max(t1, t);
      if (v !== null && v > max) max = v;
    }
  }
  if (t1 === t0) t1 = t0 + 1;
  const yMax = niceMax(max);
  const innerW = WIDTH - PAD.left - PAD.right;
  const innerH = HEIGHT - PAD.top - PAD.bottom;
  const X = (t) => PAD.left + ((t - t0) / (t1 - t0)) * innerW;
  const Y = (v) => PAD.top + innerH * (1 - v / yMax);
  svg.appendChild(
    axes(yMax, unit, [
      [PAD.left, clock(t0), "start"],
      [WIDTH - PAD.right, clock(t1), "end"],
    ]),
  );
  const legend = h("ul", { class: "legend" });
  const latest = [];
  series.forEach((x, i) => {
    const colour = COLOURS[i % COLOURS.length];
    const points = x.points.filter(([, v]) => v !== null && v !== undefined);
    const d = points.map(([t, v], j) => `${j ? "L" : "M"}${X(t).toFixed(1)},${Y(v).toFixed(1)}`).join(" ");
    svg.appendChild(s("path", { d, fill: "none", stroke: colour, "stroke-width": 2 }));
    if (points.length === 1) {
      const [t, v] = points[0];
      svg.appendChild(s("circle", { cx: X(t), cy: Y(v), r: 3, fill: colour }));
    }
    const last = points.length ? points[points.length - 1][1] : null;
    latest.push(`${x.label || "value"}: ${num(last, 2)}${unit ? ` ${unit}` : ""}`);
    legend.appendChild(
      h("li", {}, h("span", { class: "swatch", style: `background:${colour}` }), x.label || "value"),
    );
  });
  return frame(title, unit, testid, svg, series.length > 1 || series[0].label ? legend : null, `Latest: ${latest.join("; ")}`);
}

/** A bar chart of current values: [{label, value}]. */
export function barChart(items, { title = "", unit = "", testid = null } = {}) {
  const svg = s("svg", { viewBox: `0 0 ${WIDTH} ${HEIGHT}`, role: "img", "aria-label": title });
  svg.appendChild(s("title", {}, title));
  const max = Math.max(0, ...items.map((x) => x.value || 0));
  const yMax = niceMax(max);
  svg.appendChild(axes(yMax, unit, []));
  const innerW = WIDTH - PAD.left - PAD.right;
  const innerH = HEIGHT - PAD.top - PAD.bottom;
  const slot = items.length ? innerW / items.length : innerW;
  items.forEach((x, i) => {
    const v = x.value || 0;
    const barH = (v / yMax) * innerH;
    const left = PAD.left + i * slot + slot * 0.15;
    const rect = s("rect", {
      x: left,
      y: PAD.top + innerH - barH,
      width: Math.max(1, slot * 0.7),
      height: barH,
      fill: COLOURS[0],
    });
    rect.appendChild(s("title", {}, `${x.label}: ${num(v)}`));
    svg.appendChild(rect);
    if (items.length <= 24) {
      svg.appendChild(s("text", { x: left + slot * 0.35, y: HEIGHT - 8, "text-anchor": "middle" }, x.label));
    }
  });
  if (!items.length) {
    svg.appendChild(s("text", { x: WIDTH / 2, y: HEIGHT / 2, "text-anchor": "middle", class: "nodata" }, "no data"));
  }
  return frame(title, unit, testid, svg, null, null);
}

/**
 * Draw `render(await load())` into `container` now and every `intervalMs`; a failed load keeps
 * the last chart and shows the failure under it. Returns a function that stops the refresh.
 */
export function liveChart(container, load, render, intervalMs = 5000) {
  let stopped = false;
  let timer = null;
  const note = h("p", { class: "muted small", role: "status" });
  async function tick() {
    try {
      const data = await load();
      if (stopped) return;
      container.replaceChildren(render(data), note);
      note.textContent = data && data.source ? `Source: ${data.source}; refreshed ${new Date().toISOString().slice(11, 19)} UTC` : "";
    } catch (err) {
      if (stopped) return;
      if (!container.contains(note)) container.appendChild(note);
      note.textContent = `Chart not refreshed: ${err.detail || err.message}`;
    } finally {
      if (!stopped) timer = setTimeout(tick, intervalMs);
    }
  }
  tick();
  return () => {
    stopped = true;
    clearTimeout(timer);
  };
}
