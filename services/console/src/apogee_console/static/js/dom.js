// Small DOM helpers: build elements without innerHTML (text is always text), format values.

/**
 * h("tag", {testid, class, onclick, ...attributes}, ...children) -> element.
 * Children may be strings, numbers, nodes, arrays of those, or null/undefined/false (skipped).
 */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "testid") el.dataset.testid = value;
    else if (key === "class") el.className = value;
    else if (key.startsWith("on") && typeof value === "function") {
      el.addEventListener(key.slice(2), value);
    } else if (key === "value") el.value = value;
    else if (value === true) el.setAttribute(key, "");
    else el.setAttribute(key, String(value));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    if (Array.isArray(child)) append(el, child);
    else if (child instanceof Node) el.appendChild(child);
    else el.appendChild(document.createTextNode(String(child)));
  }
}

/** Append `children` to `el` (null, undefined and false are skipped, unlike Element.append). */
export function put(el, ...children) {
  append(el, children);
  return el;
}

/** Replace every child of `el` with `children`. */
export function fill(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

/**
 * A table: `columns` are [heading, (row) -> cell content, width?]; `rowAttrs(row)` gives row
 * attributes. The layout is fixed (app.css): a column takes its `width` (a CSS length, e.g.
 * "12%"), the columns without one share the rest, and no value can widen the table (long ones
 * wrap, or are cut: see `cut`).
 */
export function table(columns, rows, { testid, rowAttrs, empty = "Nothing here yet.", caption } = {}) {
  if (!rows || rows.length === 0) {
    return h("p", { class: "muted", testid: testid ? `${testid}-empty` : null }, empty);
  }
  const cols = columns.map(([, , width]) => {
    const col = h("col");
    if (width) col.style.width = width;
    return col;
  });
  return h(
    "table",
    { testid },
    caption ? h("caption", {}, caption) : null,
    h("colgroup", {}, cols),
    h("thead", {}, h("tr", {}, columns.map(([heading]) => h("th", { scope: "col" }, heading)))),
    h(
      "tbody",
      {},
      rows.map((row) =>
        h("tr", rowAttrs ? rowAttrs(row) : {}, columns.map(([, cell]) => h("td", {}, cell(row)))),
      ),
    ),
  );
}

/** A labelled form field; `input` is the control element. */
export function field(label, input, hint) {
  const id = input.id || `f-${Math.random().toString(36).slice(2, 10)}`;
  input.id = id;
  return h(
    "div",
    { class: "field" },
    h("label", { for: id }, label),
    input,
    hint ? h("small", { class: "muted" }, hint) : null,
  );
}

/** A value on one line, cut with "…" where its cell ends; the whole value is its title (a tooltip). */
export function cut(value, testid) {
  const text = show(value);
  return h("span", { class: "cut", title: text, testid }, text);
}

/** Characters of a long value shown before "Show all" (see `long`). */
export const LONG_CHARS = 300;

/**
 * A value that may be long: up to `max` characters shown, the rest behind a "Show all (N
 * characters)" button that shows it whole (and "Show less" again). `testid` names the text
 * (`<testid>-text`) and the button (`<testid>-more`).
 */
export function long(value, { max = LONG_CHARS, testid } = {}) {
  const text = show(value);
  if (text.length <= max) return text;
  const shown = h("span", { class: "long-text", testid: testid ? `${testid}-text` : null }, `${text.slice(0, max)}…`);
  const more = h("button", { type: "button", class: "link more", "aria-expanded": "false", testid: testid ? `${testid}-more` : null });
  const label = () => (more.getAttribute("aria-expanded") === "true" ? "Show less" : `Show all (${num(text.length)} characters)`);
  more.textContent = label();
  more.addEventListener("click", () => {
    const open = more.getAttribute("aria-expanded") !== "true";
    more.setAttribute("aria-expanded", String(open));
    shown.textContent = open ? text : `${text.slice(0, max)}…`;
    more.textContent = label();
  });
  return h("span", { class: "long" }, shown, " ", more);
}

/** "—" for unknown values (null/undefined), else the value as text. */
export function show(value) {
  return value === null || value === undefined ? "—" : String(value);
}

/** A number with thousands separators, or "—" when unknown. */
export function num(value, digits = 0) {
  if (value === null || value === undefined || Number.isNaN(value)) return "—";
  return Number(value).toLocaleString("en-US", { maximumFractionDigits: digits });
}

/** Epoch milliseconds as "YYYY-MM-DD HH:MM:SS UTC" (naive times in forms mean UTC, as in the CLI). */
export function time(ms) {
  if (ms === null || ms === undefined || ms <= 0) return "—";
  return new Date(ms).toISOString().replace("T", " ").replace(/\.\d+Z$/, " UTC");
}

/** The value of a datetime-local input, read as UTC, in epoch milliseconds (null when empty). */
export function utcInput(value) {
  if (!value) return null;
  const ms = Date.parse(value.length === 16 ? `${value}:00Z` : `${value}Z`);
  return Number.isNaN(ms) ? null : ms;
}

/** A page URL: ui("topics", {name: "T"}) -> "/ui/topics?name=T". */
export function ui(page, params) {
  const query = params ? new URLSearchParams(params).toString() : "";
  return `/ui/${page}${query ? `?${query}` : ""}`;
}

/** The page of one stored copy of message `id` (an id may be stored more than once): `copy` says where. */
export function messagePage(id, copy) {
  const { topic, broker, queue_id, queue_offset } = copy;
  return ui("messages", { id, topic, broker, queue_id, queue_offset });
}

/** A status dot with words (never colour alone). */
export function okBadge(ok) {
  return h("span", { class: ok ? "badge ok" : "badge bad" }, ok ? "up" : "down");
}
