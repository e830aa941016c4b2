// The operations console: a page for a shop's staff over stockd's own API, with the
// same credentials (an admin or operator token) and the same rules. Nothing here
// decides anything: every change is an API call the server checks.
"use strict";

(function () {
  const main = document.getElementById("main");
  const sections = document.getElementById("sections");
  const who = document.getElementById("who");
  const logout = document.getElementById("logout");
  const toast = document.getElementById("toast");
  const confirmDialog = document.getElementById("confirm");
  const TOKEN_KEY = "stockd-console-token";
  const REFRESH_MILLISECONDS = 5000;
  const HISTORY_POINTS = 60;
  let me = null;
  let liveTimer = null;

  // ---- small helpers ----

  function element(tag, attributes, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attributes || {})) {
      if (value === undefined || value === null || value === false) continue;
      if (name === "class") node.className = value;
      else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
      else node.setAttribute(name, value === true ? "" : String(value));
    }
    for (const child of children.flat()) {
      if (child === undefined || child === null || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function field(label, input) {
    return element("label", {}, label, input);
  }

  function badge(text) {
    return element("span", { class: `badge ${text}` }, text);
  }

  function time(text) {
    if (!text) return "";
    const date = new Date(text);
    return Number.isNaN(date.getTime()) ? text : date.toLocaleString();
  }

  function say(message) {
    const line = element("div", {}, message);
    toast.append(line);
    setTimeout(() => line.remove(), 4000);
  }

  // What to do after a change whose outcome is not known (a dropped connection, a 5xx,
  // a 409 request_in_progress): the same change again goes with the same key.
  const SUBMIT_AGAIN = "Submit it again as it is, within ten minutes: it goes with the same Idempotency-Key, so it cannot be made twice.";

  function problemBox(error) {
    const data = error.data || {};
    return element("div", { class: "problem", role: "alert" },
      element("strong", {}, `${error.status || ""} ${data.code || "error"}`), ": ",
      data.detail || error.message || String(error),
      error.outcomeUnknown ? element("p", {}, `Whether this change was made is not known. ${SUBMIT_AGAIN}`) : null,
      error.status === 429 ? element("p", {}, `Nothing was changed: stockd refused it before doing anything. Try again in ${error.retryAfter || 1} s.`) : null);
  }

  class ApiProblem extends Error {
    constructor(status, data, outcomeUnknown, retryAfter) {
      super((data && data.detail) || `HTTP ${status}`);
      this.status = status;
      this.data = data;
      this.outcomeUnknown = outcomeUnknown === true;
      this.retryAfter = retryAfter;
    }
  }

  function idempotencyKey() {
    if (window.crypto && crypto.randomUUID) return `console-${crypto.randomUUID()}`;
    return `console-${Date.now()}-${Math.random().toString(16).slice(2)}`;
  }

  // Changes whose outcome is not known (the connection failed, or a 5xx or
  // "in progress" came back), by request, with the Idempotency-Key they went with: the
  // same change submitted again goes with the same key, so the server answers it once
  // (a receipt booked once, not twice). A final answer (2xx or another 4xx) forgets it.
  // Kept in the tab's storage, as the token is: reloading the page is what people do
  // after a failed connection, and the change submitted again must keep its key. For
  // ten minutes from its last try only, and forgotten at log-out: an identical change
  // made later (the next delivery of the same quantity) is a new one, not a retry. A
  // shelf change sets a state, so one with a known outcome forgets the other shelf
  // changes still unknown: after "off", the earlier "on" made again is a new change,
  // not the replay of the first one's answer. An answer that is a replay says so
  // (`Idempotent-Replayed`), so nothing passes for booked twice.
  const UNKNOWN_OUTCOMES_MAX = 50;
  const UNKNOWN_OUTCOME_LIFETIME_MILLISECONDS = 10 * 60 * 1000;
  const UNKNOWN_OUTCOMES_KEY = "stockd-console-unknown-outcomes";
  const SHELF_PATH = "/v1/admin/shelf";
  const unknownOutcomes = new Map(storedUnknownOutcomes());

  function storedUnknownOutcomes() {
    try {
      const stored = JSON.parse(sessionStorage.getItem(UNKNOWN_OUTCOMES_KEY) || "[]");
      if (!Array.isArray(stored)) return [];
      return stored
        .filter((entry) => Array.isArray(entry) && entry.length === 2 && typeof entry[0] === "string"
          && entry[1] && typeof entry[1].key === "string" && Number.isFinite(entry[1].at))
        .slice(-UNKNOWN_OUTCOMES_MAX);
    } catch (error) {
      return [];
    }
  }

  function forgetUnknownOutcomes() {
    unknownOutcomes.clear();
    sessionStorage.removeItem(UNKNOWN_OUTCOMES_KEY);
  }

  function storeUnknownOutcomes() {
    try {
      sessionStorage.setItem(UNKNOWN_OUTCOMES_KEY, JSON.stringify([...unknownOutcomes]));
    } catch (error) {
      // Storage full or refused: the keys still hold until the page is left.
    }
  }

  // A 429 (this credential's rate, a full queue or waiting room, the credential
  // lookups shed) is answered before anything is done: its outcome is known, nothing.
  function outcomeKnown(status, data) {
    if (status >= 500) return false;
    return !(status === 409 && data && data.code === "request_in_progress");
  }

  // The newest Stockd-Consistency-Token a change's answer carried: every read sends it
  // back, so a page refreshed after a change shows the change even when a replica
  // serves the read (it waits for the replica, or goes to the primary).
  let consistencyToken = null;

  function position(token) {
    const [high, low] = token.split("/").map((part) => parseInt(part, 16));
    return Number.isFinite(high) && Number.isFinite(low) ? high * 2 ** 32 + low : null;
  }

  function noteConsistencyToken(token) {
    if (!token || position(token) === null) return;
    if (consistencyToken === null || position(token) > position(consistencyToken)) consistencyToken = token;
  }

  // Every call carries the token; every change an Idempotency-Key: a new one for a
  // new change, the same one for a change submitted again after an unknown outcome.
  async function api(method, path, body) {
    const headers = { authorization: `Bearer ${sessionStorage.getItem(TOKEN_KEY) || ""}`, accept: "application/json" };
    if (method === "GET" && consistencyToken !== null) headers["stockd-consistency-token"] = consistencyToken;
    const request = `${method} ${path} ${JSON.stringify(body === undefined ? null : body)}`;
    if (method !== "GET") {
      const unknown = unknownOutcomes.get(request);
      const fresh = unknown && Date.now() - unknown.at < UNKNOWN_OUTCOME_LIFETIME_MILLISECONDS;
      const key = fresh ? unknown.key : idempotencyKey();
      unknownOutcomes.delete(request);
      unknownOutcomes.set(request, { key, at: Date.now() });
      if (unknownOutcomes.size > UNKNOWN_OUTCOMES_MAX) unknownOutcomes.delete(unknownOutcomes.keys().next().value);
      storeUnknownOutcomes();
      headers["idempotency-key"] = key;
    }
    if (body !== undefined) headers["content-type"] = "application/json";
    let response;
    try {
      response = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
    } catch (error) {
      if (method === "GET") throw error;
      throw new Error(`The connection failed, so whether this change was made is not known. ${SUBMIT_AGAIN}`);
    }
    if (method !== "GET") noteConsistencyToken(response.headers.get("stockd-consistency-token"));
    const type = response.headers.get("content-type") || "";
    const data = type.includes("json") ? await response.json() : await response.text();
    if (data && typeof data === "object" && response.headers.get("idempotent-replayed") === "true") {
      Object.defineProperty(data, "replayed", { value: true });
    }
    if (method !== "GET" && outcomeKnown(response.status, data)) {
      unknownOutcomes.delete(request);
      if (path === SHELF_PATH) {
        for (const pending of [...unknownOutcomes.keys()]) {
          if (pending.startsWith(`POST ${SHELF_PATH} `)) unknownOutcomes.delete(pending);
        }
      }
      storeUnknownOutcomes();
    }
    if (response.status === 401 && path !== "/v1/me") {
      sessionStorage.removeItem(TOKEN_KEY);
      forgetUnknownOutcomes();
      location.hash = "#login";
      throw new ApiProblem(401, data);
    }
    if (!response.ok) {
      const retryAfter = Number.parseInt(response.headers.get("retry-after") || "", 10);
      throw new ApiProblem(response.status, data, method !== "GET" && !outcomeKnown(response.status, data), Number.isFinite(retryAfter) ? retryAfter : undefined);
    }
    return data;
  }

  // A modal question; `ready`, when given, keeps the confirming button disabled until
  // it holds (checked at every keystroke in the dialog).
  function ask(title, body, confirmLabel, danger, ready) {
    return new Promise((resolve) => {
      document.getElementById("confirm-title").textContent = title;
      const holder = document.getElementById("confirm-body");
      holder.replaceChildren(body);
      const yes = document.getElementById("confirm-yes");
      yes.textContent = confirmLabel || "Confirm";
      yes.className = danger ? "danger" : "";
      yes.disabled = ready ? !ready() : false;
      // A property, not a listener: the next question replaces this one's check.
      holder.oninput = ready ? () => (yes.disabled = !ready()) : null;
      confirmDialog.returnValue = "cancel";
      confirmDialog.addEventListener("close", () => resolve(confirmDialog.returnValue === "yes"), { once: true });
      confirmDialog.showModal();
      const firstInput = holder.querySelector("input");
      if (firstInput) firstInput.focus();
    });
  }

  function table(headings, rows) {
    return element("table", {},
      element("thead", {}, element("tr", {}, headings.map((heading) => element("th", { scope: "col", class: heading.number ? "number" : null }, heading.title || heading)))),
      element("tbody", {}, rows));
  }

  function isAdmin() {
    return me && me.role === "admin";
  }

  // ---- login ----

  function renderLogin(message) {
    sections.hidden = true;
    logout.hidden = true;
    who.textContent = "";
    const token = element("input", { id: "token", type: "password", autocomplete: "off", required: true, size: 48 });
    const form = element("form", { class: "card", "aria-labelledby": "login-title" },
      element("h1", { id: "login-title" }, "Log in"),
      element("p", { class: "muted" }, "Paste the admin token (printed by ", element("code", {}, "stockd serve"), ") or an operator token. The console calls the same API with it; nothing is stored but in this tab."),
      message ? element("div", { class: "problem", role: "alert" }, message) : null,
      element("div", { class: "row" }, field("Token", token), element("button", { type: "submit" }, "Log in")));
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      sessionStorage.setItem(TOKEN_KEY, token.value.trim());
      try {
        const found = await api("GET", "/v1/me");
        if (found.role === "service") {
          sessionStorage.removeItem(TOKEN_KEY);
          renderLogin("That is a service key (a checkout backend's). The console is for staff: use an admin or operator token.");
          return;
        }
        me = found;
        location.hash = "#stock";
        route();
      } catch (error) {
        sessionStorage.removeItem(TOKEN_KEY);
        renderLogin(error.status === 401 ? "stockd does not know this token (or it was revoked)." : error.message);
      }
    });
    main.replaceChildren(form);
    token.focus();
  }

  function renderUnreachable(error) {
    sections.hidden = true;
    logout.hidden = false;
    who.textContent = "";
    const again = element("button", { type: "button" }, "Try again");
    again.addEventListener("click", route);
    main.replaceChildren(element("div", { class: "card" },
      element("h1", {}, "stockd did not answer"),
      problemBox(error),
      element("p", { class: "muted" }, "You are still logged in."),
      again));
    again.focus();
  }

  // ---- stock ----

  function renderStock(sku) {
    const code = element("input", { id: "sku-code", required: true, value: sku || "", autocomplete: "off", pattern: "[A-Za-z0-9][A-Za-z0-9._\\-]*", maxlength: 64 });
    const result = element("div");
    const search = element("form", { class: "card", role: "search" },
      element("h1", {}, "Stock"),
      element("div", { class: "row" }, field("SKU code", code), element("button", { type: "submit" }, "Find")));
    search.addEventListener("submit", (event) => {
      event.preventDefault();
      showSku(code.value.trim(), result);
    });
    main.replaceChildren(search, result);
    if (sku) showSku(sku, result);
    else code.focus();
  }

  async function showSku(code, holder) {
    holder.replaceChildren(element("p", { class: "muted" }, "Loading…"));
    let sku;
    try {
      sku = await api("GET", `/v1/skus/${encodeURIComponent(code)}`);
    } catch (error) {
      holder.replaceChildren(problemBox(error));
      return;
    }
    const kind = element("select", { id: "movement-kind" },
      element("option", { value: "receive" }, "Receive (goods in)"),
      element("option", { value: "adjust" }, "Adjust (count correction, ±)"));
    const quantity = element("input", { id: "movement-quantity", type: "number", required: true, step: 1, min: -1000000, max: 1000000 });
    const warehouse = element("input", { id: "movement-warehouse", value: "default", required: true, maxlength: 32 });
    const movement = element("form", { class: "card", "aria-labelledby": "movement-title" },
      element("h2", { id: "movement-title" }, "Record a stock movement"),
      element("div", { class: "row" }, field("Kind", kind), field("Quantity", quantity), field("Warehouse", warehouse), element("button", { type: "submit" }, "Record…")));
    movement.addEventListener("submit", async (event) => {
      event.preventDefault();
      const amount = Number(quantity.value);
      const what = kind.value === "receive" ? `Receive ${amount} unit(s) of ${sku.sku} into ${warehouse.value}?` : `Adjust ${sku.sku} in ${warehouse.value} by ${amount > 0 ? "+" : ""}${amount}?`;
      if (!(await ask("Record this movement?", element("p", {}, what), "Record"))) return;
      try {
        const recorded = await api("POST", `/v1/skus/${encodeURIComponent(sku.sku)}/stock-movements`, { kind: kind.value, quantity: amount, warehouse: warehouse.value });
        say(recorded.replayed
          ? `Already recorded as ${recorded.movement_id} (this movement was submitted before, its answer lost): not booked again. Available ${recorded.available}, reserved ${recorded.reserved}.`
          : `Recorded ${recorded.movement_id}: available ${recorded.available}, reserved ${recorded.reserved}.`);
        showSku(sku.sku, holder);
      } catch (error) {
        movement.append(problemBox(error));
      }
    });
    holder.replaceChildren(
      element("section", { class: "card", "aria-labelledby": "sku-title" },
        element("h2", { id: "sku-title" }, sku.title || sku.sku, " ", element("span", { class: "mono muted" }, sku.sku)),
        element("p", {}, badge(sku.sale_status), " shop ", element("code", {}, sku.shop), ` · version ${sku.version}`, sku.low_stock ? element("span", { class: "badge warn" }, "low stock") : null),
        element("p", { class: "muted small" }, `As of ${time(sku.as_of)}`),
        table([{ title: "Warehouse" }, { title: "Available", number: true }, { title: "Reserved", number: true }, { title: "On hand", number: true }],
          [...sku.warehouses.map((level) => element("tr", {},
            element("td", {}, level.warehouse),
            element("td", { class: "number" }, level.available),
            element("td", { class: "number" }, level.reserved),
            element("td", { class: "number" }, level.on_hand))),
          element("tr", {}, element("th", { scope: "row" }, "Total"), element("td", { class: "number" }, sku.available), element("td", { class: "number" }, sku.reserved), element("td", { class: "number" }, sku.on_hand))])),
      movement);
  }

  // ---- catalog and shelf ----

  async function renderCatalog() {
    const category = element("input", { id: "filter-category", maxlength: 64 });
    const supplier = element("input", { id: "filter-supplier", maxlength: 64 });
    const list = element("div");
    const filters = element("form", { class: "card", role: "search" },
      element("h1", {}, "Catalog & shelf"),
      element("div", { class: "row" }, field("Category", category), field("Supplier", supplier), element("button", { type: "submit" }, "Show products")));
    const schedules = element("section", { class: "card", "aria-labelledby": "schedules-title" });
    const log = element("section", { class: "card", "aria-labelledby": "log-title" });
    // After a change, what it changed: the pending schedules and the log.
    const refresh = () => {
      loadSchedules(schedules);
      loadShelfLog(log);
    };
    const show = () => loadProducts(list, category.value.trim(), supplier.value.trim(), refresh);
    filters.addEventListener("submit", (event) => {
      event.preventDefault();
      show();
    });
    main.replaceChildren(filters, list, newProductForm(show), schedules, log);
    show();
    refresh();
  }

  function query(parameters) {
    const search = new URLSearchParams();
    for (const [name, value] of Object.entries(parameters)) if (value) search.set(name, value);
    const text = search.toString();
    return text ? `?${text}` : "";
  }

  // Products are listed oldest first, 200 a page: the console follows the pages (up to
  // 10,000 products), or a product created after the first 200 would never show.
  const PRODUCT_PAGES_MAX = 50;

  async function loadProducts(holder, category, supplier, changed) {
    holder.replaceChildren(element("p", { class: "muted" }, "Loading…"));
    const products = [];
    let complete = false;
    try {
      let after = null;
      for (let pages = 0; pages < PRODUCT_PAGES_MAX && !complete; pages += 1) {
        const page = await api("GET", `/v1/admin/products${query({ category, supplier, limit: 200, after })}`);
        products.push(...page.products.filter((product) => !product.deleted));
        after = page.next_after;
        complete = after === null || after === undefined;
      }
    } catch (error) {
      holder.replaceChildren(problemBox(error));
      return;
    }
    const selected = new Set();
    const rows = products.map((product) => {
      const box = element("input", { type: "checkbox", "aria-label": `Select ${product.title}` });
      box.addEventListener("change", () => (box.checked ? selected.add(product.product_id) : selected.delete(product.product_id)));
      const reload = () => {
        loadProducts(holder, category, supplier, changed);
        changed();
      };
      const edit = element("button", { class: "secondary", type: "button", "aria-label": `Edit ${product.title}…`, onclick: () => editProduct(product, holder, reload) }, "Edit…");
      const remove = isAdmin() ? element("button", { class: "danger", type: "button", "aria-label": `Delete ${product.title}…`, onclick: () => deleteProduct(product, holder, reload) }, "Delete…") : null;
      return element("tr", {},
        element("td", {}, box),
        element("td", {}, element("strong", {}, product.title), product.image_url ? null : element("span", { class: "badge warn" }, "no image"),
          element("div", { class: "mono small muted" }, product.product_id)),
        element("td", {}, product.category),
        element("td", {}, product.supplier),
        element("td", {}, product.skus.map((sku) => element("div", {}, element("code", {}, sku.sku), " ", badge(sku.sale_status), ` ${sku.available} available`))),
        element("td", {}, edit, " ", remove));
    });
    const when = element("input", { id: "shelf-when", type: "datetime-local", step: 60 });
    const remark = element("input", { id: "shelf-remark", maxlength: 500 });
    const results = element("div", { "aria-live": "polite", "data-shelf-results": true });
    const apply = async (operation) => {
      if (selected.size === 0) {
        results.replaceChildren(element("div", { class: "problem" }, "Select at least one product."));
        return;
      }
      // In one order whatever the order of the clicks: the same change submitted again
      // is the same request, with the same key.
      const body = { operation, product_ids: [...selected].sort(), remark: remark.value || undefined };
      if (operation.endsWith("_at")) {
        if (!when.value) {
          results.replaceChildren(element("div", { class: "problem" }, "Choose the minute it should happen."));
          return;
        }
        body.scheduled_at = new Date(when.value).toISOString();
      }
      const words = { on: "Put on the shelf now", off: "Take off the shelf now", on_at: `Put on the shelf at ${when.value}`, off_at: `Take off the shelf at ${when.value}` }[operation];
      if (!(await ask(`${words}?`, element("p", {}, `${selected.size} product(s) selected.`), words))) return;
      let answer;
      try {
        answer = await api("POST", SHELF_PATH, body);
      } catch (error) {
        results.replaceChildren(problemBox(error));
        if (error.data && error.data.results) showShelfResults(results, error.data, true);
        return;
      }
      // The change is made: its result is shown even when the list cannot be read
      // again (which then shows its own error), so nobody takes it for a failure and
      // makes it a second time.
      await loadProducts(holder, category, supplier, changed);
      let fresh = holder.querySelector("[data-shelf-results]");
      if (!fresh) {
        fresh = element("div", { "aria-live": "polite", "data-shelf-results": true });
        holder.append(fresh);
      }
      showShelfResults(fresh, answer);
      changed();
    };
    holder.replaceChildren(element("section", { class: "card", "aria-labelledby": "products-title" },
      element("h2", { id: "products-title" }, `Products (${products.length}${complete ? "" : "+"})`),
      complete ? null : element("p", { class: "muted" }, `Showing the first ${products.length}: choose a category or supplier to see the others.`),
      products.length === 0 ? element("p", { class: "muted" }, "No product matches.") :
        table(["", "Product", "Category", "Supplier", "SKUs", ""], rows),
      element("h3", {}, "Selected products"),
      element("div", { class: "row" },
        element("button", { type: "button", onclick: () => apply("on") }, "On shelf now"),
        element("button", { type: "button", class: "secondary", onclick: () => apply("off") }, "Off shelf now"),
        field("At the minute", when),
        element("button", { type: "button", onclick: () => apply("on_at") }, "On at…"),
        element("button", { type: "button", class: "secondary", onclick: () => apply("off_at") }, "Off at…"),
        field("Remark", remark)),
      results));
  }

  function showShelfResults(holder, answer, refused) {
    holder.append(element("div", { class: refused ? "problem" : "notice" },
      refused ? "Every target was refused." : `${answer.changed || 0} changed, ${answer.repeated || 0} repeated, ${answer.scheduled || 0} scheduled, ${answer.refused || 0} refused.`),
      table(["SKU", "Outcome", "From", "To", "Why / when"], (answer.results || []).map((result) => element("tr", {},
        element("td", {}, element("code", {}, result.sku)),
        element("td", {}, badge(result.outcome)),
        element("td", {}, result.from || ""),
        element("td", {}, result.to || ""),
        element("td", {}, result.reason || (result.due_at ? time(result.due_at) : ""))))));
  }

  // A product's own fields (its SKUs' prices are the SKU's): only what was changed is
  // sent, with the version this page showed, so another editor's change made since is
  // not overwritten (409 version_conflict, nothing changed: reload and edit again).
  async function editProduct(product, holder, changed) {
    const inputs = {
      title: element("input", { id: "edit-title", required: true, maxlength: 200, value: product.title }),
      image_url: element("input", { id: "edit-image", type: "url", placeholder: "https://…", value: product.image_url || "" }),
      category: element("input", { id: "edit-category", required: true, maxlength: 64, value: product.category }),
      supplier: element("input", { id: "edit-supplier", required: true, maxlength: 64, value: product.supplier }),
    };
    const body = element("div", {},
      element("p", { class: "muted small" }, "A product needs a title, an image and a price before its SKUs can go on the shelf."),
      field("Title", inputs.title), field("Image URL", inputs.image_url), field("Category", inputs.category), field("Supplier", inputs.supplier));
    const changes = () => {
      const edited = {};
      for (const [name, input] of Object.entries(inputs)) {
        const value = input.value.trim();
        if (value && value !== (product[name] || "")) edited[name] = value;
      }
      return edited;
    };
    if (!(await ask(`Edit ${product.title}`, body, "Save changes", false, () => Object.keys(changes()).length > 0))) return;
    const edited = changes();
    if (Object.keys(edited).length === 0) return;
    try {
      const saved = await api("PATCH", `/v1/products/${product.product_id}`, { ...edited, expected_version: product.version });
      say(`Saved ${saved.title}.`);
      changed();
    } catch (error) {
      holder.prepend(problemBox(error));
    }
  }

  async function deleteProduct(product, holder, changed) {
    const typed = element("input", { id: "delete-confirmation", autocomplete: "off" });
    const body = element("div", {},
      element("p", {}, "Deleting is not taking off the shelf: every SKU of ", element("strong", {}, product.title), " becomes DELETED for good and can never be sold again."),
      element("div", { class: "danger-zone" }, field(`Type the product's title (${product.title}) to confirm`, typed)));
    if (!(await ask("Delete this product for good?", body, "Delete product", true, () => typed.value === product.title))) return;
    if (typed.value !== product.title) return;
    try {
      await api("DELETE", `/v1/products/${product.product_id}`);
      say(`Deleted ${product.title}.`);
      changed();
    } catch (error) {
      holder.prepend(problemBox(error));
    }
  }

  function newProductForm(created) {
    const inputs = {
      title: element("input", { id: "new-title", required: true, maxlength: 200 }),
      image_url: element("input", { id: "new-image", type: "url", placeholder: "https://…" }),
      category: element("input", { id: "new-category", required: true, maxlength: 64 }),
      supplier: element("input", { id: "new-supplier", required: true, maxlength: 64 }),
      shop: element("input", { id: "new-shop", required: true, maxlength: 64, value: (me && me.shop) || "", readonly: me && me.shop ? true : null }),
      sku: element("input", { id: "new-sku", required: true, maxlength: 64 }),
      price: element("input", { id: "new-price", type: "number", required: true, min: 0, step: 1 }),
      currency: element("input", { id: "new-currency", required: true, value: "CNY", maxlength: 3 }),
    };
    const form = element("form", { class: "card", "aria-labelledby": "new-product-title" },
      element("h2", { id: "new-product-title" }, "New product"),
      element("p", { class: "muted small" }, "A new product's SKUs start PENDING_REVIEW: put them on the shelf when the title, image and price are right. Prices are in minor units (fen, cents)."),
      element("div", { class: "row" },
        field("Title", inputs.title), field("Image URL", inputs.image_url), field("Category", inputs.category),
        field("Supplier", inputs.supplier), field("Shop", inputs.shop)),
      element("div", { class: "row" },
        field("SKU code", inputs.sku), field("Price (minor units)", inputs.price), field("Currency", inputs.currency),
        element("button", { type: "submit" }, "Create product")));
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const body = {
        title: inputs.title.value, category: inputs.category.value, supplier: inputs.supplier.value, shop: inputs.shop.value,
        skus: [{ sku: inputs.sku.value, price: Number(inputs.price.value), currency: inputs.currency.value }],
      };
      if (inputs.image_url.value) body.image_url = inputs.image_url.value;
      const summary = element("p", {}, "Create ", element("strong", {}, body.title), ` in shop ${body.shop} (${body.category}, ${body.supplier}) with SKU `,
        element("code", {}, body.skus[0].sku), ` at ${body.skus[0].price} ${body.skus[0].currency} minor units? It starts PENDING_REVIEW, off sale.`);
      if (!(await ask("Create this product?", summary, "Create product"))) return;
      // The previous try's alert (its outcome unknown, say) no longer holds.
      for (const stale of form.querySelectorAll(".problem")) stale.remove();
      try {
        const product = await api("POST", "/v1/products", body);
        say(`Created ${product.title} (${product.product_id}).`);
        form.reset();
        inputs.shop.value = (me && me.shop) || "";
        inputs.currency.value = "CNY";
        created();
      } catch (error) {
        form.append(problemBox(error));
      }
    });
    return form;
  }

  async function loadSchedules(holder) {
    holder.replaceChildren(element("h2", { id: "schedules-title" }, "Pending schedules"));
    try {
      const page = await api("GET", "/v1/admin/schedules?limit=200");
      if (page.schedules.length === 200) holder.append(element("p", { class: "muted" }, "The 200 due soonest; more are pending."));
      holder.append(page.schedules.length === 0 ? element("p", { class: "muted" }, "Nothing scheduled.") :
        table(["Due", "SKU", "Operation", "By", "Remark", ""], page.schedules.map((schedule) => element("tr", {},
          element("td", {}, time(schedule.due_at)),
          element("td", {}, element("code", {}, schedule.sku)),
          element("td", {}, schedule.operation === "on" ? "on shelf" : "off shelf"),
          element("td", {}, schedule.operator_id),
          element("td", {}, schedule.remark),
          element("td", {}, element("button", { type: "button", class: "secondary", "aria-label": `Cancel the schedule of ${schedule.sku} at ${time(schedule.due_at)}`, onclick: async () => {
            const what = `${schedule.operation === "on" ? "Putting" : "Taking"} ${schedule.sku} ${schedule.operation === "on" ? "on" : "off"} the shelf at ${time(schedule.due_at)} will not happen. Nothing on the shelf changes now.`;
            if (!(await ask("Cancel this schedule?", element("p", {}, what), "Cancel schedule", true))) return;
            try {
              await api("POST", `/v1/admin/schedules/${encodeURIComponent(schedule.schedule_id)}/cancel`);
              say(`Schedule ${schedule.schedule_id} cancelled.`);
              loadSchedules(holder);
            } catch (error) {
              holder.append(problemBox(error));
            }
          } }, "Cancel…"))))));
    } catch (error) {
      holder.append(problemBox(error));
    }
  }

  // The log pages oldest first and is kept for good: the newest entries are the last
  // pages of a recent window. The last day's, read to its end (keeping the newest 200);
  // when that is more than the pages allowed, the last hour's, then the last five
  // minutes'. Reading from the start instead showed a busy shop its oldest entries.
  const SHELF_LOG_SHOWN = 200;
  const SHELF_LOG_PAGE = 500;
  const SHELF_LOG_PAGES_MAX = 20;
  const SHELF_LOG_WINDOWS = [["day", 86400000], ["hour", 3600000], ["five minutes", 300000]];

  async function newestShelfLog(sinceMilliseconds) {
    const since = new Date(Date.now() - sinceMilliseconds).toISOString().replace(/\.\d{3}Z$/, "Z");
    let newest = [];
    let after = null;
    for (let page = 0; page < SHELF_LOG_PAGES_MAX; page += 1) {
      const answer = await api("GET", `/v1/admin/shelf-log${query({ limit: SHELF_LOG_PAGE, since, after })}`);
      newest = newest.concat(answer.entries).slice(-SHELF_LOG_SHOWN);
      if (answer.entries.length < SHELF_LOG_PAGE || answer.next_after === null) return { newest, complete: true };
      after = answer.next_after;
    }
    return { newest, complete: false };
  }

  async function loadShelfLog(holder) {
    holder.replaceChildren(element("h2", { id: "log-title" }, "Shelf log"));
    try {
      let read = null;
      let span = null;
      for (const [name, milliseconds] of SHELF_LOG_WINDOWS) {
        span = name;
        read = await newestShelfLog(milliseconds);
        if (read.complete) break;
      }
      const entries = read.newest.reverse();
      holder.append(element("p", { class: "muted small" }, read.complete ?
        `The newest changes of the last ${span}, up to ${SHELF_LOG_SHOWN}.` :
        `More changes in the last ${span} than this page reads: the newest of its first ${SHELF_LOG_PAGE * SHELF_LOG_PAGES_MAX}.`));
      holder.append(entries.length === 0 ? element("p", { class: "muted" }, `No shelf change in the last ${span}.`) :
        table(["When", "SKU", "Operator", "Change", "Operation", "Remark"], entries.map((entry) => element("tr", {},
          element("td", {}, time(entry.created_at)),
          element("td", {}, element("code", {}, entry.sku)),
          element("td", {}, entry.operator_id, element("div", { class: "small muted" }, entry.operator_type)),
          element("td", {}, badge(entry.from), " → ", badge(entry.to), entry.repeated ? element("span", { class: "small muted" }, " (repeat)") : null),
          element("td", {}, entry.operation),
          element("td", {}, entry.remark)))));
    } catch (error) {
      holder.append(problemBox(error));
    }
  }

  // ---- orders ----

  function renderOrders(initial) {
    const search = element("input", { id: "order-search", required: true, autocomplete: "off", placeholder: "ord_… or a shopper's id" });
    const results = element("div");
    const form = element("form", { class: "card", role: "search" },
      element("h1", {}, "Orders"),
      element("div", { class: "row" }, field("Order id or shopper", search), element("button", { type: "submit" }, "Search")));
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      findOrders(search.value.trim(), results);
    });
    main.replaceChildren(form, results);
    if (initial) findOrders(initial, results);
    else search.focus();
  }

  async function findOrders(text, holder) {
    holder.replaceChildren(element("p", { class: "muted" }, "Loading…"));
    if (/^ord_[0-9a-f]{28}$/.test(text)) {
      showOrder(text, holder);
      return;
    }
    try {
      const page = await api("GET", `/v1/orders${query({ user_id: text, limit: 200 })}`);
      holder.replaceChildren(element("section", { class: "card", "aria-labelledby": "order-list-title" },
        element("h2", { id: "order-list-title" }, `Orders of ${text} (${page.orders.length}${page.next_before ? "+" : ""})`),
        page.next_before ? element("p", { class: "muted" }, "The newest 200: find an older order by its id.") : null,
        page.orders.length === 0 ? element("p", { class: "muted" }, "None.") :
          table(["Order", "Status", { title: "Amount", number: true }, "Created"], page.orders.map((order) => element("tr", {},
            element("td", {}, element("a", { href: `#orders/${order.order_id}` }, element("code", {}, order.order_id))),
            element("td", {}, badge(order.status)),
            element("td", { class: "number" }, `${order.amount} ${order.currency}`),
            element("td", {}, time(order.created_at)))))));
    } catch (error) {
      holder.replaceChildren(problemBox(error));
    }
  }

  async function showOrder(id, holder) {
    let order;
    try {
      order = await api("GET", `/v1/orders/${id}`);
    } catch (error) {
      holder.replaceChildren(problemBox(error));
      return;
    }
    const actions = element("div", { class: "row" });
    // A paid order is a staff decision (operator or admin); an unpaid one belongs to
    // the shop's checkout, and of the staff only the admin may cancel it.
    const cancellable = order.status === "PAID"
      || (isAdmin() && ["PENDING_PAYMENT", "PAYMENT_FAILED"].includes(order.status));
    if (cancellable) {
      actions.append(element("button", { type: "button", class: "danger", onclick: async () => {
        const paid = order.status === "PAID";
        const text = paid ? "The order was paid: cancelling refunds the payment (the refund worker sends it to the gateway)." : "The order's reserved stock goes back on sale.";
        if (!(await ask("Cancel this order?", element("p", {}, text), "Cancel order", true))) return;
        try {
          await api("POST", `/v1/orders/${id}/cancel`);
          say(`Order ${id} cancelled.`);
          showOrder(id, holder);
        } catch (error) {
          holder.prepend(problemBox(error));
        }
      } }, "Cancel order…"));
    }
    // Goods can come back from a paid order, also once it was cancelled and its
    // refund is under way or done: staff often refund first and book the parcel later.
    const returnable = ["PAID", "REFUND_PENDING", "REFUNDED"].includes(order.status);
    if (returnable && order.reservation.status === "CONFIRMED" && !order.returned) {
      actions.append(element("button", { type: "button", class: "secondary", onclick: async () => {
        if (!(await ask("Take the goods back?", element("p", {}, "Every line of the order goes back to available stock, once. The sale status is not changed."), "Return goods"))) return;
        try {
          await api("POST", `/v1/orders/${id}/return`);
          say(`Order ${id} returned.`);
          showOrder(id, holder);
        } catch (error) {
          holder.prepend(problemBox(error));
        }
      } }, "Return goods…"));
    }
    holder.replaceChildren(element("section", { class: "card", "aria-labelledby": "order-title" },
      element("h2", { id: "order-title" }, "Order ", element("code", {}, order.order_id), " ", badge(order.status)),
      element("p", {}, `Shopper ${order.user_id} · shop ${order.shop} · ${order.amount} ${order.currency} · created ${time(order.created_at)}`),
      actions,
      element("h3", {}, "Lines"),
      table(["SKU", "Warehouse", { title: "Quantity", number: true }, { title: "Unit price", number: true }], order.lines.map((line) => element("tr", {},
        element("td", {}, element("code", {}, line.sku)), element("td", {}, line.warehouse),
        element("td", { class: "number" }, line.quantity), element("td", { class: "number" }, line.unit_price)))),
      element("h3", {}, "Reservation"),
      element("p", {}, element("code", {}, order.reservation.reservation_id), " ", badge(order.reservation.status), ` · holds until ${time(order.reservation.expires_at)}`),
      element("h3", {}, "Status history"),
      table(["When", "From", "To", "Why"], order.history.map((entry) => element("tr", {},
        element("td", {}, time(entry.at)), element("td", {}, entry.from || ""), element("td", {}, badge(entry.to)), element("td", {}, entry.reason)))),
      element("h3", {}, "Payment attempts"),
      order.payment_attempts.length === 0 ? element("p", { class: "muted" }, "None.") :
        table(["Attempt", "Status", "Method", "Gateway id", "Why it failed"], order.payment_attempts.map((attempt) => element("tr", {},
          element("td", {}, element("code", {}, attempt.attempt_id)), element("td", {}, badge(attempt.status)),
          element("td", {}, attempt.payment_method), element("td", {}, attempt.gateway_payment_id || ""), element("td", {}, attempt.failure_reason || "")))),
      element("h3", {}, "Refunds"),
      order.refunds.length === 0 ? element("p", { class: "muted" }, "None.") :
        table(["Refund", "Status", { title: "Amount", number: true }, "Reason", "Why it failed", "Decision", ""], order.refunds.map((refund) => element("tr", {},
          element("td", {}, element("code", {}, refund.refund_id)), element("td", {}, badge(refund.status)),
          element("td", { class: "number" }, `${refund.amount} ${refund.currency}`), element("td", {}, refund.reason),
          element("td", {}, refund.failure_reason || ""),
          element("td", {}, refund.resolution ? `${refund.resolution.resolution === "send_again" ? "sent again" : "refunded elsewhere"} by ${refund.resolution.by}: ${refund.resolution.remark}` : ""),
          element("td", {}, refund.status === "FAILED" && me && me.role !== "service" ?
            element("button", { type: "button", class: "secondary", onclick: () => resolveRefund(order, refund, holder) }, "Resolve refund…") : null))))));
  }

  // A refund the gateway refused waits for a person: sent again once its cause is
  // gone, or recorded as refunded another way (the gateway's dashboard, a transfer).
  async function resolveRefund(order, refund, holder) {
    const resolution = element("select", { id: "refund-resolution" },
      element("option", { value: "send_again" }, "Send it again (the cause is gone)"),
      element("option", { value: "refunded_elsewhere" }, "Refunded outside stockd (the order becomes REFUNDED)"));
    const remark = element("input", { id: "refund-remark", required: true, maxlength: 500, placeholder: "why, or what was done instead" });
    const body = element("div", {},
      element("p", {}, `The gateway refused refund ${refund.refund_id} of ${refund.amount} ${refund.currency}: ${refund.failure_reason || "no reason given"}.`),
      field("Decision", resolution), field("Remark", remark));
    if (!(await ask("Resolve this refund?", body, "Resolve refund", false, () => remark.value.trim().length > 0))) return;
    try {
      await api("POST", `/v1/orders/${order.order_id}/refunds/${refund.refund_id}/resolve`, { resolution: resolution.value, remark: remark.value.trim() });
      say(`Refund ${refund.refund_id} resolved.`);
      showOrder(order.order_id, holder);
    } catch (error) {
      holder.prepend(problemBox(error));
    }
  }

  // ---- audit ----

  function renderAudit() {
    const result = element("div", { "aria-live": "polite" });
    const run = element("button", { type: "button", onclick: async () => {
      run.disabled = true;
      result.replaceChildren(element("p", { class: "muted" }, "Running the audit…"));
      try {
        const report = await api("GET", "/v1/audit");
        result.replaceChildren(
          element("div", { class: report.ok ? "notice" : "problem", role: report.ok ? "status" : "alert" },
            report.ok ? "Clean: the ledger, the counters, the reservations and the orders agree." : `${report.differences_total} difference(s) found.`),
          element("p", { class: "small muted" }, `Checked ${time(report.checked_at)}: ${report.stock_rows_checked} stock rows, ${report.reservation_lines_checked} reservation lines, ${report.orders_checked} orders, ${report.ledger_rows_checked} ledger rows.`),
          report.differences.length === 0 ? null :
            table(["Check", "SKU", "Warehouse", "Reference", { title: "Expected", number: true }, { title: "Actual", number: true }], report.differences.map((difference) => element("tr", {},
              element("td", {}, difference.check), element("td", {}, difference.sku || ""), element("td", {}, difference.warehouse || ""),
              element("td", {}, difference.reference || ""), element("td", { class: "number" }, difference.expected), element("td", { class: "number" }, difference.actual)))));
      } catch (error) {
        result.replaceChildren(problemBox(error));
      } finally {
        run.disabled = false;
      }
    } }, "Run the audit");
    main.replaceChildren(element("section", { class: "card" }, element("h1", {}, "Audit"),
      element("p", { class: "muted" }, "Replays the append-only ledger against every stock counter, checks the reservations' holds and every order against its reservation and payment."),
      run, result));
    run.focus();
  }

  // ---- live figures from /metrics ----

  function parseMetrics(text) {
    const samples = [];
    for (const line of text.split("\n")) {
      if (!line || line.startsWith("#")) continue;
      const match = line.match(/^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)/);
      if (!match) continue;
      const labels = {};
      if (match[3]) for (const pair of match[3].matchAll(/([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g)) labels[pair[1]] = pair[2];
      samples.push({ name: match[1], labels, value: Number(match[4]) });
    }
    return samples;
  }

  function total(samples, name, predicate) {
    return samples.filter((sample) => sample.name === name && (!predicate || predicate(sample.labels))).reduce((sum, sample) => sum + sample.value, 0);
  }

  // A quantile of a histogram's increase between two scrapes (as histogram_quantile).
  function quantile(previous, current, name, q, predicate) {
    const buckets = new Map();
    for (const sample of current) {
      if (sample.name !== `${name}_bucket` || (predicate && !predicate(sample.labels))) continue;
      const le = sample.labels.le === "+Inf" ? Infinity : Number(sample.labels.le);
      buckets.set(le, (buckets.get(le) || 0) + sample.value);
    }
    for (const sample of previous) {
      if (sample.name !== `${name}_bucket` || (predicate && !predicate(sample.labels))) continue;
      const le = sample.labels.le === "+Inf" ? Infinity : Number(sample.labels.le);
      buckets.set(le, (buckets.get(le) || 0) - sample.value);
    }
    const bounds = [...buckets.keys()].sort((a, b) => a - b);
    const count = buckets.get(Infinity) || 0;
    if (count <= 0) return null;
    const rank = q * count;
    let below = 0;
    let lower = 0;
    for (const bound of bounds) {
      const cumulative = buckets.get(bound);
      if (cumulative >= rank) {
        if (bound === Infinity) return lower;
        const inBucket = cumulative - below;
        return inBucket > 0 ? lower + (bound - lower) * ((rank - below) / inBucket) : bound;
      }
      below = cumulative;
      lower = bound;
    }
    return lower;
  }

  function sparkline(points, secondPoints) {
    const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
    svg.setAttribute("viewBox", "0 0 100 40");
    svg.setAttribute("preserveAspectRatio", "none");
    svg.setAttribute("aria-hidden", "true");
    const all = points.concat(secondPoints || []).filter(Number.isFinite);
    const top = Math.max(1e-9, ...all);
    const line = (values, className) => {
      const polyline = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
      const step = values.length > 1 ? 100 / (HISTORY_POINTS - 1) : 0;
      const start = 100 - step * (values.length - 1);
      polyline.setAttribute("points", values.map((value, index) => `${(start + index * step).toFixed(2)},${(40 - ((value || 0) / top) * 38).toFixed(2)}`).join(" "));
      if (className) polyline.setAttribute("class", className);
      svg.append(polyline);
    };
    line(points);
    if (secondPoints) line(secondPoints, "second");
    return svg;
  }

  function renderLive() {
    const grid = element("div", { class: "grid" });
    const hot = element("section", { class: "card", "aria-labelledby": "hot-title" }, element("h2", { id: "hot-title" }, "Hot SKUs (duplicate requests)"));
    const stamp = element("p", { class: "small muted", "aria-live": "polite" }, "Reading /metrics…");
    // /metrics describes the whole service: only the hot SKUs are this shop's. An
    // operator is told so, or another shop's audit difference reads as one of theirs.
    const scope = me && me.shop
      ? element("p", { class: "notice", role: "note" }, `These figures are the whole service's, every shop's together; only the hot SKUs are shop ${me.shop}'s. The Audit page checks your shop alone.`)
      : null;
    main.replaceChildren(element("h1", {}, "Live"), scope, stamp, grid, hot);
    const history = new Map();
    let previous = null;
    let previousAt = 0;
    const remember = (name, value) => {
      const list = history.get(name) || [];
      list.push(value);
      while (list.length > HISTORY_POINTS) list.shift();
      history.set(name, list);
      return list;
    };
    const tile = (title, value, unit, points, secondPoints, note) => element("div", { class: "chart" },
      element("div", { class: "small muted" }, title),
      element("div", { class: "value" }, value === null || value === undefined ? "—" : value, unit ? element("span", { class: "small muted" }, ` ${unit}`) : null),
      note ? element("div", { class: "small muted" }, note) : null,
      sparkline(points, secondPoints));
    // One scrape at a time, and none while the tab is hidden: each scrape runs the
    // database gauges' queries.
    let scraping = false;
    const tick = async () => {
      if (scraping || document.hidden) return;
      scraping = true;
      let text;
      try {
        text = await api("GET", "/metrics");
      } catch (error) {
        stamp.replaceChildren(problemBox(error));
        return;
      } finally {
        scraping = false;
      }
      const now = Date.now();
      const current = parseMetrics(text);
      const seconds = previous ? (now - previousAt) / 1000 : null;
      const rate = (name, predicate) => (previous && seconds > 0 ? Math.max(0, (total(current, name, predicate) - total(previous, name, predicate)) / seconds) : null);
      const requests = rate("stockd_http_responses_total");
      const reservations = rate("stockd_http_responses_total", (labels) => labels.route === "/v1/reservations" && labels.method === "POST" && labels.status === "201");
      const p50 = previous ? quantile(previous, current, "stockd_http_request_duration_seconds", 0.5) : null;
      const p99 = previous ? quantile(previous, current, "stockd_http_request_duration_seconds", 0.99) : null;
      const batch = previous ? quantile(previous, current, "stockd_combiner_batch_size", 0.5) : null;
      const milliseconds = (value) => (value === null ? null : Number((value * 1000).toFixed(1)));
      // An unhealthy replica's lag is NaN: it is counted apart, not folded into the
      // largest lag (Math.max over a NaN is NaN, and so would be the chart).
      const lags = current.filter((sample) => sample.name === "stockd_replica_lag_seconds");
      const unreachable = lags.filter((sample) => !Number.isFinite(sample.value)).length;
      const measured = lags.filter((sample) => Number.isFinite(sample.value)).map((sample) => sample.value);
      const worstLag = measured.length === 0 ? null : Math.max(...measured);
      const lagValue = lags.length === 0 ? "no replicas" : worstLag === null ? "unreachable" : worstLag.toFixed(2);
      const lagNote = unreachable === 0 ? null : `${unreachable} of ${lags.length} replica(s) unreachable`;
      const tiles = [
        tile("Requests", requests === null ? null : requests.toFixed(1), "/s", remember("requests", requests)),
        tile("Reservations made", reservations === null ? null : reservations.toFixed(1), "/s", remember("reservations", reservations)),
        tile("Latency p50 / p99", p50 === null ? null : `${milliseconds(p50)} / ${milliseconds(p99)}`, "ms", remember("p50", milliseconds(p50)), remember("p99", milliseconds(p99))),
        tile("Batch size (median)", batch === null ? null : batch.toFixed(1), "per commit", remember("batch", batch)),
        tile("Unknown payments", total(current, "stockd_payment_attempts_unresolved"), "", remember("unknown", total(current, "stockd_payment_attempts_unresolved"))),
        tile("Refund backlog", total(current, "stockd_refunds_pending"), "", remember("refunds", total(current, "stockd_refunds_pending"))),
        tile("Outbox age", total(current, "stockd_outbox_oldest_pending_age_seconds").toFixed(1), "s", remember("outbox", total(current, "stockd_outbox_oldest_pending_age_seconds")), null, `${total(current, "stockd_outbox_pending")} event(s) pending`),
        tile("Replica lag", lagValue, worstLag === null ? "" : "s", remember("lag", worstLag), null, lagNote),
        tile("Open holds", total(current, "stockd_reservations", (labels) => labels.status === "RESERVED"), "", remember("holds", total(current, "stockd_reservations", (labels) => labels.status === "RESERVED"))),
        tile("Audit differences", total(current, "stockd_audit_differences"), "", remember("audit", total(current, "stockd_audit_differences"))),
      ];
      grid.replaceChildren(...tiles);
      const hottest = current.filter((sample) => sample.name === "stockd_hot_sku_duplicate_requests_total").sort((a, b) => b.value - a.value);
      hot.replaceChildren(element("h2", { id: "hot-title" }, "Hot SKUs (duplicate requests)"),
        hottest.length === 0 ? element("p", { class: "muted" }, "No duplicate requests yet.") :
          table(["SKU", { title: "Duplicates", number: true }], hottest.map((sample) => element("tr", {}, element("td", {}, element("code", {}, sample.labels.sku)), element("td", { class: "number" }, sample.value)))));
      stamp.textContent = `Updated ${new Date(now).toLocaleTimeString()} · every ${REFRESH_MILLISECONDS / 1000} s`;
      previous = current;
      previousAt = now;
    };
    tick();
    liveTimer = setInterval(tick, REFRESH_MILLISECONDS);
  }

  // ---- routing ----

  // Each navigation's number: a slow answer to an earlier one (its /v1/me failing
  // after a later one succeeded) must not draw over the later one's page.
  let routeGeneration = 0;

  async function route() {
    const generation = ++routeGeneration;
    toast.replaceChildren();
    if (liveTimer) {
      clearInterval(liveTimer);
      liveTimer = null;
    }
    if (!sessionStorage.getItem(TOKEN_KEY)) {
      renderLogin();
      return;
    }
    if (!me) {
      try {
        const found = await api("GET", "/v1/me");
        if (generation !== routeGeneration) return;
        me = found;
      } catch (error) {
        if (generation !== routeGeneration) return;
        if (error.status === 401) {
          sessionStorage.removeItem(TOKEN_KEY);
          renderLogin("Your token is no longer valid: log in again.");
        } else {
          // The server could not be asked (it restarts, the network failed): the token
          // is still good, so it stays, with the changes whose outcome is unknown.
          renderUnreachable(error);
        }
        return;
      }
    }
    sections.hidden = false;
    logout.hidden = false;
    who.textContent = me.role === "admin" ? "admin · every shop" : `${me.operator_id || me.role} · shop ${me.shop}`;
    const [section, argument] = (location.hash.replace(/^#/, "") || "stock").split("/");
    for (const link of sections.querySelectorAll("a")) {
      if (link.getAttribute("href") === `#${section}`) link.setAttribute("aria-current", "page");
      else link.removeAttribute("aria-current");
    }
    const views = { stock: () => renderStock(argument), catalog: renderCatalog, orders: () => renderOrders(argument), audit: renderAudit, live: renderLive };
    (views[section] || views.stock)();
    document.title = `stockd console · ${section}`;
    main.focus();
  }

  logout.addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    forgetUnknownOutcomes();
    me = null;
    location.hash = "#login";
    renderLogin();
  });
  window.addEventListener("hashchange", route);
  route();
})();
