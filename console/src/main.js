// The console's shell: who is signed in, the navigation, and which page renders. Pages are
// modules exporting `render(main, ctx)`, which may return a function that stops their timers.
import { ApiError, call, del, get } from "./api.js";
import { alertBox, field, h, replace, showError } from "./dom.js";
import * as adapters from "./pages/adapters.js";
import * as batches from "./pages/batches.js";
import * as fleet from "./pages/fleet.js";
import * as keys from "./pages/keys.js";
import * as playground from "./pages/playground.js";
import * as queue from "./pages/queue.js";
import * as tenants from "./pages/tenants.js";
import * as usage from "./pages/usage.js";

const PAGES = {
  usage: { title: "Usage", module: usage, role: "tenant" },
  batches: { title: "Batches", module: batches, role: "tenant" },
  adapters: { title: "Adapters", module: adapters, role: "tenant" },
  keys: { title: "API keys", module: keys, role: "tenant" },
  playground: { title: "Playground", module: playground, role: "tenant" },
  fleet: { title: "Fleet", module: fleet, role: "operator" },
  tenants: { title: "Tenants", module: tenants, role: "operator" },
  queue: { title: "Batch queue", module: queue, role: "operator" },
};

const app = document.getElementById("app");
let who = null;
let stop = null;

function pageName() {
  const name = location.pathname.replace(/^\/console\/?/, "").split("/")[0];
  return name;
}

export function navigate(name) {
  history.pushState({}, "", `/console/${name}`);
  show();
}

function signInPage() {
  const key = h("input", { type: "password", name: "key", autocomplete: "current-password", required: true });
  const box = alertBox();
  const form = h(
    "form",
    { class: "card signin", "aria-labelledby": "signin-title" },
    h("h1", { id: "signin-title" }, "Sign in to Tandem"),
    field("API key", key, "A tenant's key, or an operator's. It is kept in an HttpOnly session cookie, never in the page."),
    box,
    h("button", { type: "submit", class: "primary" }, "Sign in"),
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    try {
      who = await call("POST", "/console/session", { key: key.value });
      navigate(who.role === "operator" ? "fleet" : "usage");
    } catch (error) {
      showError(box, error);
      key.focus();
    }
  });
  return h("main", { id: "main" }, form);
}

function shell(current) {
  const pages = Object.entries(PAGES).filter(([, page]) => page.role === who.role);
  const nav = h(
    "nav",
    { "aria-label": "Console" },
    h(
      "ul",
      {},
      pages.map(([name, page]) =>
        h(
          "li",
          {},
          h(
            "a",
            {
              href: `/console/${name}`,
              "aria-current": name === current ? "page" : undefined,
              onclick: (event) => {
                event.preventDefault();
                navigate(name);
              },
            },
            page.title,
          ),
        ),
      ),
    ),
  );
  const signOut = h(
    "button",
    {
      type: "button",
      class: "link",
      onclick: async () => {
        await del("/console/session");
        who = null;
        navigate("signin");
      },
    },
    "Sign out",
  );
  const identity = who.role === "operator" ? "Operator" : `Tenant ${who.tenant}`;
  return h(
    "header",
    { class: "top" },
    h("span", { class: "brand" }, "Tandem"),
    nav,
    h("span", { class: "who" }, identity, " ", signOut),
  );
}

async function show() {
  if (stop) {
    stop();
    stop = null;
  }
  if (who === null) {
    try {
      who = await get("/console/session");
    } catch (error) {
      if (!(error instanceof ApiError) || error.status !== 401) throw error;
    }
  }
  let name = pageName();
  if (who === null) {
    if (name !== "signin") history.replaceState({}, "", "/console/signin");
    document.title = "Sign in · Tandem console";
    replace(app, signInPage());
    return;
  }
  if (!PAGES[name]) {
    name = who.role === "operator" ? "fleet" : "usage";
    history.replaceState({}, "", `/console/${name}`);
  }
  const page = PAGES[name];
  document.title = `${page.title} · Tandem console`;
  const main = h("main", { id: "main", class: "page" }, h("h1", {}, page.title));
  replace(app, h("a", { href: "#main", class: "skip" }, "Skip to content"), shell(name), main);
  stop = page.module.render(main, { who, navigate }) || null;
}

window.addEventListener("popstate", show);
show();
