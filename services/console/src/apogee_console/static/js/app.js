// The console's single-page app: session, navigation, the error area, and the page modules.
//
// Pages live at /ui/<page>[?name=...|?id=...]; "/" shows the cluster. Each page module exports
// `title` and `render(ctx)`; `ctx` gives it the session, the <main> element, the URL's query,
// and helpers that stop their timers when the user leaves the page.

import { api, ApiError, setCsrf, setUnauthorizedHandler } from "./api.js";
import { h, long } from "./dom.js";
import * as cluster from "./pages/cluster.js";
import * as dlq from "./pages/dlq.js";
import * as groups from "./pages/groups.js";
import * as login from "./pages/login.js";
import * as messages from "./pages/messages.js";
import * as schedule from "./pages/schedule.js";
import * as topics from "./pages/topics.js";
import * as transactions from "./pages/transactions.js";

const PAGES = { login, cluster, topics, groups, messages, dlq, transactions, schedule };
const DEFAULT_PAGE = "cluster";

const main = document.querySelector("main");
const nav = document.querySelector("nav");
const errors = document.querySelector("[data-testid=error-area]");
const banner = document.querySelector("[data-testid=auth-off-banner]");
const who = document.querySelector("[data-testid=session]");

let session = null;
let disposers = [];
let generation = 0;

/** True when the console runs without login ("open": every visitor is admin). */
function isOpen(s) {
  return Boolean(s) && (s.via === "open" || s.open === true || s.auth === false);
}

export function setSession(s) {
  session = s;
  setCsrf(s ? s.csrf : null);
  const loggedIn = Boolean(s);
  nav.hidden = !loggedIn;
  who.hidden = !loggedIn;
  banner.hidden = !isOpen(s);
  if (s) {
    who.querySelector("[data-testid=session-user]").textContent = isOpen(s) ? "open console" : s.user;
    who.querySelector("[data-testid=session-role]").textContent = s.role;
    who.querySelector("[data-testid=logout]").hidden = isOpen(s);
  }
}

function showError(err) {
  const detail = err instanceof ApiError ? err.detail : err && err.message ? err.message : String(err);
  errors.replaceChildren(
    h("p", { testid: "error-detail" }, long(detail)),
    h("button", { type: "button", class: "link", testid: "error-dismiss", onclick: clearError }, "Dismiss"),
  );
  errors.hidden = false;
}

function clearError() {
  errors.replaceChildren();
  errors.hidden = true;
}

function pageOf(pathname) {
  if (pathname === "/" || pathname === "/ui" || pathname === "/ui/") return DEFAULT_PAGE;
  const match = /^\/ui\/([a-z]+)\/?$/.exec(pathname);
  return match && PAGES[match[1]] ? match[1] : null;
}

function dispose() {
  for (const fn of disposers.splice(0)) {
    try {
      fn();
    } catch {
      /* a page's cleanup must not stop navigation */
    }
  }
}

export function navigate(url, { replace = false } = {}) {
  if (replace) history.replaceState(null, "", url);
  else history.pushState(null, "", url);
  render();
}

function toLogin() {
  const here = location.pathname + location.search;
  const next = pageOf(location.pathname) === "login" ? "" : `?next=${encodeURIComponent(here)}`;
  navigate(`/ui/login${next}`, { replace: true });
}

function context(page, mine) {
  const ctx = {
    main,
    page,
    session,
    admin: Boolean(session) && session.role === "admin",
    open: isOpen(session),
    params: new URLSearchParams(location.search),
    navigate,
    setSession,
    error: showError,
    clearError,
    /** Still the page the user looks at (no navigation since it rendered). */
    get live() {
      return mine === generation;
    },
    onDispose(fn) {
      disposers.push(fn);
    },
    /** Run `fn` now and every `ms` while the page is shown (never two at once). */
    every(ms, fn) {
      let timer = null;
      let stopped = false;
      const tick = async () => {
        try {
          await fn();
        } catch (err) {
          if (!stopped && !(err instanceof ApiError && err.status === 401)) showError(err);
        } finally {
          if (!stopped) timer = setTimeout(tick, ms);
        }
      };
      disposers.push(() => {
        stopped = true;
        clearTimeout(timer);
      });
      tick();
    },
    /** Run an action (a button press): clear the error area, busy the button, show a failure. */
    async act(button, fn) {
      clearError();
      if (button) button.disabled = true;
      try {
        return await fn();
      } catch (err) {
        showError(err);
        return undefined;
      } finally {
        if (button) button.disabled = false;
      }
    },
  };
  return ctx;
}

async function render() {
  dispose();
  clearError();
  const mine = ++generation;
  let name = pageOf(location.pathname);
  if (!name) {
    navigate(`/ui/${DEFAULT_PAGE}`, { replace: true });
    return;
  }
  if (!session && name !== "login") {
    toLogin();
    return;
  }
  const module = PAGES[name];
  for (const a of nav.querySelectorAll("a")) {
    if (a.getAttribute("href") === `/ui/${name}`) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  document.title = `${module.title} · Apogee console`;
  main.replaceChildren();
  main.dataset.page = name;
  try {
    await module.render(context(name, mine));
  } catch (err) {
    if (mine === generation && !(err instanceof ApiError && err.status === 401)) showError(err);
  }
  if (mine === generation) {
    const heading = main.querySelector("h1");
    if (heading && document.activeElement === document.body) heading.setAttribute("tabindex", "-1");
  }
}

document.addEventListener("click", (event) => {
  if (event.defaultPrevented || event.button !== 0) return;
  if (event.metaKey || event.ctrlKey || event.shiftKey || event.altKey) return;
  const a = event.target.closest("a[href]");
  if (!a || a.target || a.hasAttribute("download")) return;
  const url = new URL(a.href, location.href);
  if (url.origin !== location.origin || !pageOf(url.pathname)) return;
  event.preventDefault();
  navigate(url.pathname + url.search);
});
window.addEventListener("popstate", render);

document.querySelector("[data-testid=logout]").addEventListener("click", async () => {
  try {
    await api("DELETE", "/session", undefined, { quiet401: true });
  } catch {
    /* logged out either way */
  }
  setSession(null);
  navigate("/ui/login", { replace: true });
});

setUnauthorizedHandler(() => {
  setSession(null);
  toLogin();
});

async function start() {
  let failure = null;
  try {
    setSession(await api("GET", "/session", undefined, { quiet401: true }));
  } catch (err) {
    setSession(null);
    if (!(err instanceof ApiError && err.status === 401)) failure = err;
  }
  await render();
  if (failure) showError(failure);
}

start();
