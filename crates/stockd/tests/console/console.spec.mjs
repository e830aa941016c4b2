// The operations console in headless Chromium (Debian's), driven by Playwright
// (playwright-core, no downloaded browser): an operator's day against a real
// `stockd serve --demo`, then a stranger from another shop who must see and change
// nothing. Run by crates/stockd/tests/console.rs, which starts the server and passes:
//   STOCKD_URL               the server's base URL
//   STOCKD_ADMIN_TOKEN       its admin token
//   STOCKD_SCREENSHOTS       a directory for one screenshot of each page
//   STOCKD_CHROMIUM          the browser (default /usr/bin/chromium)
// Exits 0 only when every step held; prints each step.
import assert from "node:assert/strict";
import { mkdirSync } from "node:fs";
import { join } from "node:path";
import { chromium } from "playwright-core";

const base = process.env.STOCKD_URL;
const adminToken = process.env.STOCKD_ADMIN_TOKEN;
const screenshots = process.env.STOCKD_SCREENSHOTS;
assert.ok(base && adminToken && screenshots, "STOCKD_URL, STOCKD_ADMIN_TOKEN and STOCKD_SCREENSHOTS are required");
mkdirSync(screenshots, { recursive: true });

// Bounds on every wait: a step that does not happen fails instead of hanging.
const STEP_TIMEOUT_MILLISECONDS = 15000;

function step(name) {
  console.log(`console: ${name}`);
}

async function call(method, path, body) {
  const headers = { authorization: `Bearer ${adminToken}`, "idempotency-key": `browser-test-${Math.random().toString(16).slice(2)}` };
  if (body !== undefined) headers["content-type"] = "application/json";
  const response = await fetch(`${base}${path}`, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  const data = await response.json();
  assert.ok(response.ok, `${method} ${path}: ${response.status} ${JSON.stringify(data)}`);
  return data;
}

const browser = await chromium.launch({
  executablePath: process.env.STOCKD_CHROMIUM || "/usr/bin/chromium",
  headless: true,
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync"],
});
const context = await browser.newContext({ viewport: { width: 1366, height: 900 } });
const page = await context.newPage();
page.setDefaultTimeout(STEP_TIMEOUT_MILLISECONDS);
const problems = [];
page.on("pageerror", (error) => problems.push(`page error: ${error.message}`));
page.on("console", (message) => {
  // A refused call (the stranger's 403s) is logged by the browser as a failed load:
  // the page shows it; that is no script error.
  if (message.type() === "error" && !message.text().startsWith("Failed to load resource")) {
    problems.push(`console error: ${message.text()}`);
  }
});

// Asks `check` again until it holds, within the step's bound: for what stockd's own
// workers do in the background (the refund worker's call to the gateway).
async function until(what, check) {
  const deadline = Date.now() + STEP_TIMEOUT_MILLISECONDS;
  while (!(await check())) {
    assert.ok(Date.now() < deadline, `waited too long for ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 100));
  }
}

async function shot(name) {
  await page.screenshot({ path: join(screenshots, `${name}.png`), fullPage: false });
}

async function confirmDialog(button) {
  const dialog = page.getByRole("dialog");
  await dialog.waitFor();
  await dialog.getByRole("button", { name: button, exact: true }).click();
  await dialog.waitFor({ state: "hidden" });
}

async function logIn(token) {
  await page.goto(`${base}/console`);
  await page.getByLabel("Token").fill(token);
  await page.getByRole("button", { name: "Log in" }).click();
}

try {
  step("the landing page links to the console and the reference");
  await page.goto(`${base}/`);
  await page.getByRole("link", { name: "Operations console" }).waitFor();
  await page.getByRole("link", { name: "API reference" }).waitFor();

  step("the reference renders /openapi.json without the network");
  await page.goto(`${base}/docs`);
  await page.getByRole("heading", { name: /POST \/v1\/reservations$/ }).first().waitFor();
  await page.getByLabel("Filter operations").fill("stock-movements");
  await shot("docs");

  step("log in with the admin token");
  await logIn(adminToken);
  await page.getByRole("heading", { name: "Stock" }).waitFor();
  assert.match(await page.locator("#who").textContent(), /admin/);

  step("a shop with more products than one page of the list");
  // 200 more products than the demo's: the product created next is past the list's
  // first page, which is all the console read before it followed the pages.
  for (let batch = 0; batch < 10; batch += 1) {
    await Promise.all(Array.from({ length: 20 }, (_, index) => {
      const number = batch * 20 + index;
      return call("POST", "/v1/products", {
        title: `Filler ${number}`,
        image_url: "https://images.example/filler.png",
        category: "filler",
        supplier: "filler-co",
        shop: "demo-market",
        skus: [{ sku: `FILLER-${number}`, price: 100, currency: "CNY" }],
      });
    }));
  }

  step("create a product");
  await page.getByRole("link", { name: "Catalog & shelf" }).click();
  await page.getByRole("heading", { name: "New product" }).waitFor();
  await page.getByLabel("Title").fill("Oat milk 1L");
  await page.getByLabel("Image URL").fill("https://images.example/oat-milk.png");
  await page.getByLabel("Category", { exact: true }).last().fill("dairy");
  await page.getByLabel("Supplier", { exact: true }).last().fill("oat-co");
  await page.getByLabel("Shop").fill("demo-market");
  await page.getByLabel("SKU code").fill("OAT-1L");
  await page.getByLabel("Price (minor units)").fill("1299");
  // The first try is answered 503 before it reaches stockd: the page says the outcome
  // is not known, and the same change submitted again goes with the same key.
  const creationKeys = [];
  await page.route("**/v1/products", async (route) => {
    if (route.request().method() !== "POST") return route.continue();
    creationKeys.push(route.request().headers()["idempotency-key"]);
    if (creationKeys.length === 1) {
      await route.fulfill({ status: 503, contentType: "application/problem+json", body: JSON.stringify({ code: "unavailable", status: 503, detail: "the database is unavailable" }) });
    } else {
      await route.continue();
    }
  });
  await page.getByRole("button", { name: "Create product" }).click();
  await confirmDialog("Create product");
  await page.getByRole("alert").getByText(/Whether this change was made is not known/).waitFor();
  await page.getByRole("button", { name: "Create product" }).click();
  await confirmDialog("Create product");
  const oatRow = page.getByRole("row").filter({ hasText: "Oat milk 1L" });
  await oatRow.waitFor();
  assert.match(await oatRow.textContent(), /PENDING_REVIEW/);
  await page.unroute("**/v1/products");
  assert.equal(creationKeys.length, 2);
  assert.equal(creationKeys[0], creationKeys[1], "submitted again with the same key");
  // The first try's "not known, submit it again" no longer holds once the second made it.
  assert.equal(await page.locator("form[aria-labelledby=new-product-title] [role=alert]").count(), 0);

  step("put it on the shelf, and see the change in the shelf log");
  await oatRow.getByRole("checkbox").check();
  await page.getByRole("button", { name: "On shelf now" }).click();
  await confirmDialog("Put on the shelf now");
  await page.getByText(/1 changed/).waitFor();
  await page.getByRole("row").filter({ hasText: "Oat milk 1L" }).getByText("ON_SHELF").waitFor();
  const logRow = page.locator("section[aria-labelledby=log-title] tr").filter({ hasText: "OAT-1L" });
  await logRow.first().waitFor();
  assert.match(await logRow.first().textContent(), /PENDING_REVIEW.*ON_SHELF/);
  assert.match(await logRow.first().textContent(), /admin/);

  step("a product without an image cannot go on the shelf until it is edited in");
  await call("POST", "/v1/products", {
    title: "Rye bread", category: "bakery", supplier: "rye-co", shop: "demo-market",
    skus: [{ sku: "RYE-1", price: 450, currency: "CNY" }],
  });
  await page.getByRole("button", { name: "Show products" }).click();
  const ryeRow = page.getByRole("row").filter({ hasText: "Rye bread" });
  await ryeRow.getByText("no image").waitFor();
  await ryeRow.getByRole("checkbox").check();
  await page.getByRole("button", { name: "On shelf now" }).click();
  await confirmDialog("Put on the shelf now");
  await page.getByText("Every target was refused.").waitFor();
  await ryeRow.getByRole("button", { name: "Edit Rye bread…" }).click();
  const editing = page.getByRole("dialog");
  assert.equal(await editing.getByRole("button", { name: "Save changes" }).isDisabled(), true, "nothing changed yet");
  await editing.getByLabel("Image URL").fill("https://images.example/rye.png");
  await confirmDialog("Save changes");
  await page.getByText("Saved Rye bread.").waitFor();
  await page.getByRole("row").filter({ hasText: "Rye bread" }).getByText("no image").waitFor({ state: "detached" });
  assert.equal((await call("GET", "/v1/admin/products?category=bakery&supplier=rye-co")).products[0].image_url, "https://images.example/rye.png");
  await page.getByRole("row").filter({ hasText: "Rye bread" }).getByRole("checkbox").check();
  await page.getByRole("button", { name: "On shelf now" }).click();
  await confirmDialog("Put on the shelf now");
  await page.getByRole("row").filter({ hasText: "Rye bread" }).getByText("ON_SHELF").waitFor();

  step("schedule it off the shelf at a minute two hours ahead");
  await page.getByRole("row").filter({ hasText: "Oat milk 1L" }).getByRole("checkbox").check();
  const later = new Date(Date.now() + 2 * 3600 * 1000);
  const local = new Date(later.getTime() - later.getTimezoneOffset() * 60000).toISOString().slice(0, 16);
  await page.getByLabel("At the minute").fill(local);
  await page.getByLabel("Remark").fill("end of the oat promotion");
  await page.getByRole("button", { name: "Off at…" }).click();
  await confirmDialog(`Take off the shelf at ${local}`);
  await page.getByText(/1 scheduled/).waitFor();
  const pending = page.locator("section[aria-labelledby=schedules-title] tr").filter({ hasText: "OAT-1L" });
  await pending.first().waitFor();
  assert.match(await pending.first().textContent(), /off shelf/);
  await shot("catalog");

  step("cancel that schedule from the list");
  await pending.first().getByRole("button", { name: /Cancel the schedule of OAT-1L/ }).click();
  await confirmDialog("Cancel schedule");
  await page.getByText(/^Schedule .* cancelled\.$/).waitFor();
  await pending.first().waitFor({ state: "detached" });
  const stillPending = (await call("GET", "/v1/admin/schedules?limit=200")).schedules.filter((schedule) => schedule.sku === "OAT-1L");
  assert.deepEqual(stillPending, [], "the schedule was withdrawn");

  step("deleting asks for the title: until it is typed right, nothing can be deleted");
  await page.getByRole("button", { name: "Delete Oat milk 1L…" }).click();
  const deleting = page.getByRole("dialog");
  await deleting.getByLabel(/Type the product's title/).fill("Oat milk");
  assert.equal(await deleting.getByRole("button", { name: "Delete product" }).isDisabled(), true);
  await deleting.getByLabel(/Type the product's title/).fill("Oat milk 1L");
  assert.equal(await deleting.getByRole("button", { name: "Delete product" }).isDisabled(), false);
  await deleting.getByLabel(/Type the product's title/).fill("Oat milk");
  await page.screenshot({ path: join(screenshots, "delete.png") });
  await confirmDialog("Cancel");
  await page.getByRole("row").filter({ hasText: "Oat milk 1L" }).first().waitFor();

  step("receive stock");
  await page.getByRole("link", { name: "Stock", exact: true }).click();
  await page.getByLabel("SKU code").fill("OAT-1L");
  await page.getByRole("button", { name: "Find" }).click();
  await page.getByRole("heading", { name: /Oat milk 1L/ }).waitFor();
  await page.getByLabel("Quantity").fill("25");
  await page.getByRole("button", { name: "Record…" }).click();
  await confirmDialog("Record");
  await page.getByText(/Recorded mov_/).waitFor();
  await page.getByRole("row", { name: /Total/ }).getByText("25", { exact: true }).first().waitFor();
  await shot("stock");

  step("a change refused 429 says nothing was changed and when to try again");
  await page.route("**/v1/skus/OAT-1L/stock-movements", (route) => route.fulfill({
    status: 429,
    contentType: "application/problem+json",
    headers: { "retry-after": "7" },
    body: JSON.stringify({ code: "rate_limited", status: 429, detail: "this credential sent more than its rate" }),
  }));
  await page.getByLabel("Quantity").fill("1");
  await page.getByRole("button", { name: "Record…" }).click();
  await confirmDialog("Record");
  const refusal = page.getByRole("alert").filter({ hasText: "rate_limited" });
  await refusal.getByText(/Nothing was changed.*Try again in 7 s\./).waitFor();
  assert.equal(await refusal.getByText(/not known/).count(), 0, "a 429 is no unknown outcome");
  await page.unroute("**/v1/skus/OAT-1L/stock-movements");
  await page.getByRole("button", { name: "Find" }).click();
  await page.getByRole("heading", { name: /Oat milk 1L/ }).waitFor();

  step("a receipt whose answer was lost, submitted again after a reload, is booked once");
  const movementKeys = [];
  const skuReadTokens = [];
  let movementToken = null;
  page.on("request", (request) => {
    if (request.method() === "GET" && new URL(request.url()).pathname === "/v1/skus/OAT-1L") {
      skuReadTokens.push(request.headers()["stockd-consistency-token"]);
    }
  });
  page.on("response", (response) => {
    if (response.request().method() === "POST" && response.url().endsWith("/v1/skus/OAT-1L/stock-movements")) {
      movementToken = response.headers()["stockd-consistency-token"];
    }
  });
  let loseTheAnswer = true;
  await page.route("**/v1/skus/OAT-1L/stock-movements", async (route) => {
    movementKeys.push(route.request().headers()["idempotency-key"]);
    if (loseTheAnswer) {
      // The server books it; the answer never reaches the page.
      loseTheAnswer = false;
      await route.fetch();
      await route.abort("connectionreset");
    } else {
      await route.continue();
    }
  });
  await page.getByLabel("Quantity").fill("5");
  await page.getByRole("button", { name: "Record…" }).click();
  await confirmDialog("Record");
  await page.getByRole("alert").getByText(/whether this change was made is not known/).waitFor();
  // What people do after a failed connection: reload the page, and enter the receipt
  // again. Its key was kept in the tab's storage.
  await page.reload();
  await page.getByRole("link", { name: "Stock", exact: true }).click();
  await page.getByLabel("SKU code").fill("OAT-1L");
  await page.getByRole("button", { name: "Find" }).click();
  await page.getByRole("heading", { name: /Oat milk 1L/ }).waitFor();
  await page.getByLabel("Quantity").fill("5");
  // The reloaded page already shows the first receipt (the server booked it): wait for
  // the answer to this one, not for the figure.
  const resubmitted = page.waitForResponse((response) =>
    response.request().method() === "POST" && response.url().endsWith("/v1/skus/OAT-1L/stock-movements"));
  await page.getByRole("button", { name: "Record…" }).click();
  await confirmDialog("Record");
  assert.equal((await resubmitted).status(), 201);
  await page.getByText(/Already recorded as mov_.*not booked again/).waitFor();
  await page.getByRole("row", { name: /Total/ }).getByText("30", { exact: true }).first().waitFor();
  await page.unrouteAll();
  assert.equal(movementKeys.length, 2);
  assert.equal(movementKeys[0], movementKeys[1], "submitted again with the same key");
  assert.equal((await call("GET", "/v1/skus/OAT-1L")).available, 30, "booked once");
  // The card was read again after the receipt with the receipt's position: a replica
  // behind it could not have shown the old figure.
  assert.ok(movementToken, "the receipt's answer carries a consistency token");
  assert.equal(skuReadTokens[skuReadTokens.length - 1], movementToken, "the read after it sends it back");

  step("a shelf change whose answer was lost is not replayed after another change");
  // Off (its answer lost, though the server made it), then on, then off again: the
  // second off is a new change, not a retry of the first. Replayed, it would answer
  // "1 changed" and leave the product on the shelf.
  await page.getByRole("link", { name: "Catalog & shelf" }).click();
  const shelfKeys = [];
  let loseTheShelfAnswer = true;
  await page.route("**/v1/admin/shelf", async (route) => {
    if (route.request().method() !== "POST") return route.continue();
    shelfKeys.push(route.request().headers()["idempotency-key"]);
    if (loseTheShelfAnswer) {
      loseTheShelfAnswer = false;
      await route.fetch();
      await route.abort("connectionreset");
    } else {
      await route.continue();
    }
  });
  const shelve = async (button, words) => {
    await page.getByRole("row").filter({ hasText: "Oat milk 1L" }).getByRole("checkbox").check();
    await page.getByRole("button", { name: button }).click();
    await confirmDialog(words);
  };
  await shelve("Off shelf now", "Take off the shelf now");
  await page.getByRole("alert").getByText(/whether this change was made is not known/).waitFor();
  await shelve("On shelf now", "Put on the shelf now");
  await page.getByText(/1 changed/).waitFor();
  await page.getByRole("row").filter({ hasText: "Oat milk 1L" }).getByText("ON_SHELF").waitFor();
  await shelve("Off shelf now", "Take off the shelf now");
  await page.getByRole("row").filter({ hasText: "Oat milk 1L" }).getByText("OFF_SHELF").waitFor();
  const offAgain = (await call("GET", "/v1/admin/products?category=dairy&supplier=oat-co")).products[0];
  assert.equal(offAgain.skus[0].sale_status, "OFF_SHELF", "the second off was made, not replayed");
  assert.equal(shelfKeys.length, 3);
  assert.notEqual(shelfKeys[2], shelfKeys[0], "a new key for the new change");
  await page.unrouteAll();
  await shelve("On shelf now", "Put on the shelf now");
  await page.getByRole("row").filter({ hasText: "Oat milk 1L" }).getByText("ON_SHELF").waitFor();

  step("a reload while stockd does not answer keeps the login");
  let meFailures = 0;
  await page.route("**/v1/me", async (route) => {
    meFailures += 1;
    await route.fulfill({ status: 503, contentType: "application/problem+json", body: JSON.stringify({ code: "unavailable", status: 503, detail: "stockd is starting" }) });
  });
  await page.reload();
  await page.getByRole("heading", { name: "stockd did not answer" }).waitFor();
  await page.getByText("You are still logged in.").waitFor();
  assert.equal(meFailures, 1);
  await page.unroute("**/v1/me");
  await page.getByRole("button", { name: "Try again" }).click();
  await page.getByRole("link", { name: "Orders" }).waitFor();
  await page.locator("#who").filter({ hasText: /admin/ }).waitFor();

  step("cancel an order");
  const order = await call("POST", "/v1/orders", { user_id: "ui-shopper", lines: [{ sku: "OAT-1L", quantity: 2 }] });
  await page.getByRole("link", { name: "Orders" }).click();
  await page.getByLabel("Order id or shopper").fill("ui-shopper");
  await page.getByRole("button", { name: "Search" }).click();
  await page.getByRole("link", { name: order.order_id }).click();
  await page.getByRole("heading", { name: /Order ord_/ }).waitFor();
  await page.getByRole("button", { name: "Cancel order…" }).click();
  await confirmDialog("Cancel order");
  await page.getByRole("heading", { name: /CANCELLED/ }).waitFor();
  await shot("orders");
  const cancelled = await call("GET", `/v1/orders/${order.order_id}`);
  assert.equal(cancelled.status, "CANCELLED");

  step("a paid order cancelled (refunded) can still take its goods back");
  const paid = await call("POST", "/v1/orders", { user_id: "ui-shopper", lines: [{ sku: "OAT-1L", quantity: 3 }] });
  const payment = await call("POST", `/v1/orders/${paid.order_id}/pay`, { payment_method: "pm_card_visa" });
  assert.equal(payment.status, "PAID");
  const beforeReturn = (await call("GET", "/v1/skus/OAT-1L")).available;
  await page.getByLabel("Order id or shopper").fill(paid.order_id);
  await page.getByRole("button", { name: "Search" }).click();
  await page.getByRole("heading", { name: /Order ord_.*PAID/ }).waitFor();
  await page.getByRole("button", { name: "Cancel order…" }).click();
  await confirmDialog("Cancel order");
  await page.getByRole("heading", { name: /REFUND/ }).waitFor();
  await page.getByRole("button", { name: "Return goods…" }).click();
  await confirmDialog("Return goods");
  await page.getByText(`Order ${paid.order_id} returned.`).waitFor();
  assert.equal((await call("GET", "/v1/skus/OAT-1L")).available, beforeReturn + 3, "the three units are back on sale");
  assert.equal((await call("GET", `/v1/orders/${paid.order_id}`)).returned, true);

  step("a refund the gateway refused is resolved in the console");
  const refused = await call("POST", "/v1/orders", { user_id: "ui-shopper", lines: [{ sku: "OAT-1L", quantity: 1 }] });
  assert.equal((await call("POST", `/v1/orders/${refused.order_id}/pay`, { payment_method: "pm_card_refundFail" })).status, "PAID");
  await call("POST", `/v1/orders/${refused.order_id}/cancel`);
  await until("the gateway's refusal", async () => (await call("GET", `/v1/orders/${refused.order_id}`)).refund?.status === "FAILED");
  await page.getByLabel("Order id or shopper").fill(refused.order_id);
  await page.getByRole("button", { name: "Search" }).click();
  await page.getByRole("heading", { name: /Order ord_.*REFUND_PENDING/ }).waitFor();
  await page.getByRole("button", { name: "Resolve refund…" }).click();
  await page.getByLabel("Decision").selectOption("refunded_elsewhere");
  await page.getByLabel("Remark").fill("refunded by bank transfer 4711");
  await confirmDialog("Resolve refund");
  await page.getByRole("heading", { name: /Order ord_.*REFUNDED/ }).waitFor();
  await page.getByText("refunded elsewhere by admin: refunded by bank transfer 4711").waitFor();
  const resolved = await call("GET", `/v1/orders/${refused.order_id}`);
  assert.equal(resolved.status, "REFUNDED");
  assert.equal(resolved.refund.status, "SUCCEEDED");
  assert.equal(resolved.refund.resolution.by, "admin");

  step("run the audit");
  await page.getByRole("link", { name: "Audit" }).click();
  await page.getByRole("button", { name: "Run the audit" }).click();
  await page.getByText(/^Clean:/).waitFor();
  await shot("audit");

  step("the live figures refresh from /metrics");
  // Some traffic to show: reservations of one SKU, a few of them retried.
  await call("POST", "/v1/skus/MILK-1L/stock-movements", { kind: "receive", quantity: 10000 });
  const traffic = (async () => {
    for (let round = 0; round < 30; round += 1) {
      await Promise.all(Array.from({ length: 20 }, (_, index) => fetch(`${base}/v1/reservations`, {
        method: "POST",
        headers: { authorization: `Bearer ${adminToken}`, "content-type": "application/json", "idempotency-key": `live-${round}-${index % 15}` },
        body: JSON.stringify({ lines: [{ sku: "MILK-1L", quantity: 1 }], ttl_seconds: 60 }),
      })));
      await new Promise((resolve) => setTimeout(resolve, 500));
    }
  })();
  await page.getByRole("link", { name: "Live" }).click();
  const stamp = page.getByText(/^Updated /);
  await stamp.waitFor();
  const firstStamp = await stamp.textContent();
  // A second scrape: the rates need two, and the page must refresh by itself.
  await page.waitForFunction((first) => [...document.querySelectorAll("p")].some((node) => node.textContent.startsWith("Updated ") && node.textContent !== first), firstStamp, { timeout: 3 * STEP_TIMEOUT_MILLISECONDS });
  await page.waitForFunction(() => document.querySelectorAll(".chart").length >= 8);
  const reservationsTile = page.locator(".chart").filter({ hasText: "Reservations made" }).locator(".value");
  await page.waitForFunction(() => {
    const tile = [...document.querySelectorAll(".chart")].find((node) => node.textContent.includes("Reservations made"));
    return tile && Number.parseFloat(tile.querySelector(".value").textContent) > 0;
  }, null, { timeout: 3 * STEP_TIMEOUT_MILLISECONDS });
  assert.ok(Number.parseFloat(await reservationsTile.textContent()) > 0, "reservations were counted");
  // The traffic retries its keys: the SKU is among the hot ones.
  await page.locator("section[aria-labelledby=hot-title]").getByText("MILK-1L", { exact: true }).waitFor({ timeout: 3 * STEP_TIMEOUT_MILLISECONDS });
  await shot("live");
  await traffic;

  step("an unreachable replica's lag reads as such, next to the healthy one's");
  await page.route("**/metrics", (route) => route.fulfill({
    status: 200,
    contentType: "text/plain",
    body: 'stockd_replica_lag_seconds{replica="a"} NaN\nstockd_replica_lag_seconds{replica="b"} 0.5\n',
  }));
  const lagTile = page.locator(".chart").filter({ hasText: "Replica lag" });
  await lagTile.getByText("1 of 2 replica(s) unreachable").waitFor({ timeout: 3 * STEP_TIMEOUT_MILLISECONDS });
  assert.match(await lagTile.locator(".value").textContent(), /^0\.50/);
  assert.doesNotMatch(await lagTile.innerHTML(), /NaN/);
  await page.unroute("**/metrics");

  step("an operator of another shop sees none of it and changes nothing");
  const stranger = await call("POST", "/v1/admin/operators", { operator_id: "stranger", shop: "other-shop" });
  const oat = (await call("GET", "/v1/admin/products?category=dairy&supplier=oat-co")).products[0];
  await call("POST", "/v1/admin/shelf", { operation: "off_at", product_ids: [oat.product_id], scheduled_at: new Date(Math.ceil((Date.now() + 3 * 3600 * 1000) / 60000) * 60000).toISOString(), remark: "end of the oat promotion" });
  assert.equal((await call("GET", "/v1/admin/schedules?limit=200")).schedules.filter((schedule) => schedule.sku === "OAT-1L").length, 1);
  const oatAvailable = (await call("GET", "/v1/skus/OAT-1L")).available;
  await page.getByRole("button", { name: "Log out" }).click();
  await logIn(stranger.token);
  await page.getByRole("heading", { name: "Stock" }).waitFor();
  assert.match(await page.locator("#who").textContent(), /other-shop/);
  await page.getByLabel("SKU code").fill("OAT-1L");
  await page.getByRole("button", { name: "Find" }).click();
  await page.getByRole("alert").getByText(/403 forbidden/).waitFor();
  await page.getByRole("link", { name: "Catalog & shelf" }).click();
  await page.getByRole("heading", { name: /Products \(0\)/ }).waitFor();
  // The schedules and the shelf log name SKUs and remarks, not titles: each panel is
  // read once loaded, with the admin's pending schedule of OAT-1L there to leak.
  await page.getByText("Nothing scheduled.").waitFor();
  await page.getByText(/^No shelf change in the last /).waitFor();
  assert.equal(await page.getByText("Oat milk 1L").count(), 0);
  assert.equal(await page.getByText("OAT-1L").count(), 0);
  assert.equal(await page.getByText(/oat promotion/).count(), 0);
  await page.getByRole("link", { name: "Live" }).click();
  await page.getByText(/whole service's, every shop's together/).waitFor();
  await page.getByText(/^No duplicate requests yet\./).waitFor();
  assert.equal(await page.getByText("MILK-1L").count(), 0, "another shop's hot SKU is not listed");
  await page.getByRole("link", { name: "Orders" }).click();
  await page.getByLabel("Order id or shopper").fill(order.order_id);
  await page.getByRole("button", { name: "Search" }).click();
  await page.getByRole("alert").getByText(/403 forbidden/).waitFor();
  const product = (await call("GET", "/v1/admin/products?category=dairy&supplier=oat-co")).products[0];
  assert.equal(product.skus[0].sale_status, "ON_SHELF", "the stranger changed nothing");
  const stock = await call("GET", "/v1/skus/OAT-1L");
  assert.equal(stock.available, oatAvailable, "the stranger moved no stock");

  step("a service key is not let into the console");
  const key = await call("POST", "/v1/admin/service-keys", { shop: "demo-market", name: "browser-test" });
  await page.getByRole("button", { name: "Log out" }).click();
  await logIn(key.secret);
  await page.getByText(/The console is for staff/).waitFor();
  await shot("login");

  assert.deepEqual(problems, [], "the pages raised no script error");
  console.log("console: every step held");
} catch (error) {
  // What the page showed when a step failed, for the test's output.
  await page.screenshot({ path: join(screenshots, "failure.png"), fullPage: true }).catch(() => {});
  console.log(`console: the page said: ${(await page.locator("main").innerText().catch(() => "")).slice(0, 3000)}`);
  console.log(`console: script problems: ${JSON.stringify(problems)}`);
  throw error;
} finally {
  await browser.close();
}
