// Renders one console page in Node, without a browser, and prints its HTML.
//
//   node render_page.mjs <static/js/pages/page.js> < answers.json
//
// answers.json maps API paths ("/cluster") to the JSON the page is to receive. The page's
// render(ctx) runs once against a small stand-in of the DOM (only what dom.js uses:
// elements, text, attributes, dataset, children) with fetch answering from that map; the
// HTML of the page's <main> is printed on stdout.

import { readFileSync } from "node:fs";
import { pathToFileURL } from "node:url";

const escape = (text) =>
  String(text).replaceAll("&", "&amp;").replaceAll("<", "&lt;").replaceAll(">", "&gt;").replaceAll('"', "&quot;");

class Node {}

class Text extends Node {
  constructor(text) {
    super();
    this.data = String(text);
  }
  get textContent() {
    return this.data;
  }
  get outerHTML() {
    return escape(this.data);
  }
}

class Element extends Node {
  constructor(tag) {
    super();
    this.tagName = tag;
    this.attributes = new Map();
    this.children = [];
    this.style = {};
    const attributes = this.attributes;
    this.dataset = new Proxy({}, {
      set(target, key, value) {
        attributes.set(`data-${String(key).replace(/[A-Z]/g, (c) => `-${c.toLowerCase()}`)}`, String(value));
        target[key] = value;
        return true;
      },
    });
  }
  setAttribute(name, value) {
    this.attributes.set(name, String(value));
  }
  getAttribute(name) {
    return this.attributes.has(name) ? this.attributes.get(name) : null;
  }
  set className(value) {
    this.setAttribute("class", value);
  }
  set id(value) {
    this.setAttribute("id", value);
  }
  get id() {
    return this.getAttribute("id") || "";
  }
  addEventListener() {}
  appendChild(child) {
    this.children.push(child);
    return child;
  }
  replaceChildren(...nodes) {
    this.children = [...nodes];
  }
  set textContent(text) {
    this.children = [new Text(text)];
  }
  get textContent() {
    return this.children.map((c) => c.textContent).join("");
  }
  get outerHTML() {
    const attrs = [...this.attributes].map(([k, v]) => ` ${k}="${escape(v)}"`).join("");
    const inner = this.children.map((c) => c.outerHTML).join("");
    return `<${this.tagName}${attrs}>${inner}</${this.tagName}>`;
  }
}

globalThis.Node = Node;
globalThis.document = {
  createElement: (tag) => new Element(tag),
  createTextNode: (text) => new Text(text),
};

const answers = JSON.parse(readFileSync(0, "utf8"));
globalThis.fetch = async (url) => {
  const path = String(url).replace(/^\/api\/v1/, "");
  const known = Object.hasOwn(answers, path);
  const body = JSON.stringify(known ? answers[path] : { detail: `no answer for ${path}` });
  return new Response(body, { status: known ? 200 : 404 });
};

const page = await import(pathToFileURL(process.argv[2]).href);
const main = new Element("main");
const runs = [];
await page.render({ main, live: true, every: (_ms, fn) => runs.push(fn()) });
await Promise.all(runs);
process.stdout.write(main.outerHTML);
