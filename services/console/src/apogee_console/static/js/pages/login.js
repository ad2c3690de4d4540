// Login: a console user (name and password) or, with cluster auth on, an access key and secret key.

import { api } from "../api.js";
import { field, h, put } from "../dom.js";

export const title = "Log in";

function safeNext(next) {
  // only pages of this console: never an absolute URL to elsewhere
  return next && /^\/ui\/[a-z]+/.test(next) && !next.startsWith("/ui/login") ? next : "/ui/cluster";
}

export async function render(ctx) {
  const next = safeNext(ctx.params.get("next"));
  const open = ctx.open;
  const kind = h(
    "select",
    { testid: "login-kind", name: "kind" },
    h("option", { value: "user" }, "Console user"),
    h("option", { value: "key" }, "Access key"),
  );
  const user = h("input", { testid: "login-user", name: "user", autocomplete: "username", required: true });
  const password = h("input", {
    testid: "login-password",
    name: "password",
    type: "password",
    autocomplete: "current-password",
    required: true,
  });
  const userField = field("User", user);
  const passwordField = field("Password", password);
  kind.addEventListener("change", () => {
    const key = kind.value === "key";
    userField.querySelector("label").textContent = key ? "Access key" : "User";
    passwordField.querySelector("label").textContent = key ? "Secret key" : "Password";
  });
  const submit = h("button", { type: "submit", testid: "login-submit" }, "Log in");
  const form = h(
    "form",
    { class: "card narrow", testid: "login-form", "aria-labelledby": "login-title" },
    field("Log in with", kind),
    userField,
    passwordField,
    h("div", { class: "actions" }, submit),
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    await ctx.act(submit, async () => {
      const body =
        kind.value === "key"
          ? { access_key: user.value, secret_key: password.value }
          : { user: user.value, password: password.value };
      const session = await api("POST", "/session", body, { quiet401: true });
      ctx.setSession(session);
      ctx.navigate(next, { replace: true });
    });
  });
  put(ctx.main, 
    h("h1", { id: "login-title" }, "Log in to the Apogee console"),
    open ? h("p", {}, "This console runs without login; ", h("a", { href: next }, "go on"), ".") : null,
    ctx.session && !open
      ? h("p", { class: "muted" }, `You are logged in as ${ctx.session.user} (${ctx.session.role}).`)
      : null,
    form,
  );
  user.focus();
}
