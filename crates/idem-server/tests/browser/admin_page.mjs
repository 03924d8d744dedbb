// Signs in to the admin page, filters, opens a record, reopens an unknown outcome and sees the
// counts change; saves a screenshot. Usage: node admin_page.mjs BASE_URL TOKEN SCREENSHOT
import { chromium } from "playwright-core";

const [base, token, screenshot] = process.argv.slice(2);
const executablePath = process.env.IDEM_CHROMIUM || "/usr/bin/chromium";
const fail = (message) => { console.error(`admin page: ${message}`); process.exit(1); };
setTimeout(() => fail("still running after 120 s"), 120_000).unref();

const browser = await chromium.launch({
  executablePath,
  args: ["--headless", "--no-sandbox", "--disable-background-networking"],
});
try {
  const page = await browser.newPage({ viewport: { width: 1280, height: 900 } });
  page.setDefaultTimeout(20_000);
  const errors = [];
  page.on("pageerror", (e) => errors.push(`page error: ${e.message}`));
  // The wrong token's refusals are expected; nothing else may fail.
  page.on("console", (m) => {
    if (m.type() === "error" && !m.text().includes("status of 401")) errors.push(`console: ${m.text()}`);
  });
  page.on("dialog", (d) => d.accept());

  // The prefix with a final slash leads to the page too.
  await page.goto(`${base}/_idem/`);
  if (!page.url().endsWith("/_idem")) fail(`expected a redirect to /_idem, at ${page.url()}`);

  // A wrong token is refused and the sign-in form comes back.
  try {
    await page.getByLabel("Admin token").waitFor();
  } catch (e) {
    fail(`no sign-in form: ${errors.join("; ") || e.message}`);
  }
  await page.getByLabel("Admin token").fill("not-the-token-at-all");
  await page.getByRole("button", { name: "Sign in" }).click();
  await page.getByText("That token was refused.").waitFor();

  await page.getByLabel("Admin token").fill(token);
  await page.getByRole("button", { name: "Sign in" }).click();
  const count = (state) => page.locator(`[data-state=${state}] dd`);
  await count("unknown").filter({ hasText: /^1$/ }).waitFor();
  await page.locator("#stuck").getByText("stuck-1").waitFor();
  await page.locator("#unknown").getByText("u-1").waitFor();
  await page.locator("#segments").getByText("orders").waitFor();
  await page.locator("#locks").getByText("nightly-report").waitFor();
  const lines = await page.locator("#chart polyline").count();
  if (lines !== 6) fail(`expected a chart line for each of 6 states, got ${lines}`);
  const swatch = await page.locator("#legend li").first().evaluate((e) => e.style.getPropertyValue("--c"));
  if (!swatch) fail("the chart's legend has no colours");

  // Filter to the unknown outcomes: one row.
  await page.getByLabel("State", { exact: true }).selectOption("unknown");
  await page.getByRole("button", { name: "Filter" }).click();
  const rows = page.locator("#records tbody tr");
  await rows.filter({ hasText: "u-1" }).waitFor();
  // The unfiltered table holds u-1 too: wait for the filtered one to replace it.
  const one = await page
    .waitForFunction(() => document.querySelectorAll("#records tbody tr").length === 1, null, {
      timeout: 10000,
    })
    .then(() => true, () => false);
  if (!one) fail(`expected 1 unknown outcome, got ${await rows.count()} rows`);

  // Open it, then reopen it: the counts move from unknown to released.
  await page.locator("#records").getByRole("link", { name: "u-1" }).click();
  await page.locator("#detail-fields").getByText("unknown", { exact: true }).waitFor();
  const releasedBefore = Number(await count("released").textContent());
  await page.locator("#detail-actions").getByRole("button", { name: "Reopen u-1" }).click();
  await page.getByText("reopen: 1 applied, 0 skipped").waitFor();
  await count("unknown").filter({ hasText: /^0$/ }).waitFor();
  await count("released").filter({ hasText: new RegExp(`^${releasedBefore + 1}$`) }).waitFor();

  // A stored answer is shown as it is replayed.
  await page.getByLabel("State", { exact: true }).selectOption("completed");
  await page.getByRole("button", { name: "Filter" }).click();
  await page.locator("#records").getByRole("link", { name: "order-1" }).click();
  await page.locator("#detail-answer").getByText('{"id":"order-1"}').waitFor();

  // A stuck attempt of multi-step work shows how far it got.
  await page.getByLabel("State", { exact: true }).selectOption("stuck");
  await page.getByRole("button", { name: "Filter" }).click();
  await page.locator("#records").getByRole("link", { name: "stuck-1" }).click();
  await page.locator("#detail-fields").getByText("debit (done, 3 bytes)", { exact: true }).waitFor();

  // A bulk repair acts on the filter whose result is on screen, never on one typed since.
  await page.getByLabel("State", { exact: true }).selectOption("");
  await page.getByLabel("Namespace").fill("jobs");
  await page.getByRole("button", { name: "Filter" }).click();
  await rows.filter({ hasText: "stuck-1" }).waitFor();
  await page.getByLabel("Namespace").fill("batch");
  await page.getByRole("button", { name: "Delete all matching…" }).click();
  await page.getByText("The filter was changed but not applied").waitFor();
  if (await page.locator("#bulk-dialog").isVisible()) fail("the bulk dialog opened for a filter not applied");

  // Applied, it shows what it will touch by state, and a running attempt needs its box ticked.
  await page.getByRole("button", { name: "Filter" }).click();
  await rows.filter({ hasText: "batch-running" }).waitFor();
  await page.getByRole("button", { name: "Delete all matching…" }).click();
  const dialog = page.locator("#bulk-dialog");
  await dialog.getByText("Delete 3 records?").waitFor();
  await dialog.getByText("namespace batch").waitFor();
  await dialog.getByText("2 completed", { exact: true }).waitFor();
  await dialog.getByText("1 in progress", { exact: true }).waitFor();
  const go = dialog.getByRole("button", { name: "Delete 3 records" });
  if (!(await go.isDisabled())) fail("a bulk repair touching a running attempt was offered without force");
  await dialog.getByLabel(/attempts still in progress/).check();
  await go.click();
  await page.getByText("delete: 3 applied, 0 skipped").waitFor();

  // idem's own records are shown (the Snowflake worker ids), never repaired.
  await page.locator("#workers").getByText("worker-7").waitFor();
  await page.getByLabel("Namespace").fill("");
  await page.getByLabel("Scope").fill("idem.ids");
  await page.getByRole("button", { name: "Filter" }).click();
  await rows.filter({ hasText: "worker-7" }).waitFor();
  await page.getByRole("button", { name: "Delete all matching…" }).click();
  await page.getByText("Only idem's own records match (1)").waitFor();
  await page.locator("#records").getByRole("link", { name: "worker-7" }).click();
  await page.locator("#detail-fields").getByText("snowflake.default", { exact: true }).waitFor();
  if (await page.locator("#detail-actions button").count()) fail("idem's own record is offered a repair");
  await page.getByLabel("Scope").fill("");

  // Every form control has a label.
  const unlabelled = await page.evaluate(() =>
    [...document.querySelectorAll("input, select")].filter((e) => !e.labels || e.labels.length === 0).length);
  if (unlabelled) fail(`${unlabelled} form controls have no label`);

  await page.getByLabel("State", { exact: true }).selectOption("");
  await page.getByRole("button", { name: "Filter" }).click();
  await rows.filter({ hasText: "order-2" }).waitFor();
  await page.screenshot({ path: screenshot, fullPage: true });
  if (errors.length) fail(errors.join("\n"));
  console.log("admin page: signed in, filtered, opened a record, reopened an unknown outcome, bulk-deleted what was shown");
} finally {
  await browser.close();
}
