// The admin page: reads the record tools' JSON endpoints with the admin token and draws them.
// Every value from the store is set as text, never as markup.
"use strict";

const STATES = ["in_progress", "stuck", "completed", "unknown", "released", "expired"];
const COLOURS = {
  in_progress: "#2563eb", stuck: "#d97706", completed: "#15803d",
  unknown: "#b91c1c", released: "#7c3aed", expired: "#6b7280",
};
const PAGE = 25;
const MAX_BULK = 1000;
const $ = (id) => document.getElementById(id);
// The page is served at the reserved prefix itself (`/_idem`); the endpoints are beneath it.
const BASE = location.pathname.replace(/\/+$/, "") + "/";

let token = sessionStorage.getItem("idem-admin-token");
let cursors = [null];
let current = null;
// The filter whose result is on screen: set when Filter is pressed, not as the form is typed
// in. The table's pages and the bulk repairs use this one only.
let applied = new URLSearchParams();

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "on") for (const [ev, f] of Object.entries(v)) node.addEventListener(ev, f);
    else if (v !== undefined && v !== null) node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function say(text, bad) {
  const s = $("status");
  s.textContent = text;
  s.className = bad ? "bad" : "";
}

class Refused extends Error {}

async function call(path, options) {
  const res = await fetch(BASE + path, {
    ...(options || {}),
    headers: { ...((options || {}).headers || {}), authorization: `Bearer ${token}` },
  });
  const body = await res.json().catch(() => ({}));
  if (res.status === 401) {
    signOut("That token was refused.");
    throw new Refused("refused");
  }
  if (!res.ok) throw new Error(body.detail || `${res.status}`);
  return body;
}

// The filter as the form holds it now.
function typedFilter() {
  const q = new URLSearchParams();
  for (const [k, v] of new FormData($("filter"))) if (v.trim()) q.set(k, v.trim());
  return q;
}

// The filter on screen, with `extra` (limit, cursor, a narrower state) on top.
function filterQuery(extra) {
  const q = new URLSearchParams(applied);
  for (const [k, v] of Object.entries(extra || {})) if (v !== null && v !== undefined) q.set(k, v);
  return q;
}

function describeFilter(q) {
  const parts = [...q].map(([k, v]) => `${k.replace("_", " ")} ${v}`);
  return parts.length ? parts.join(", ") : "no filter: every record";
}

function age(iso) {
  const s = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
  if (s < 120) return `${Math.round(s)}s`;
  if (s < 7200) return `${Math.round(s / 60)}m`;
  if (s < 172800) return `${Math.round(s / 3600)}h`;
  return `${Math.round(s / 86400)}d`;
}

function holds(r) {
  if (r.kind === "stored" || r.kind === "too_large") return String(r.status);
  if (r.kind === "foreign") return "value";
  return r.kind === r.state ? "" : r.kind;
}

function shownOf(r) {
  return { scope: r.scope, namespace: r.namespace, key: r.key, state: r.state, fence: r.fence };
}

// `force`: the operator said explicitly that attempts in progress may be repaired too; without
// it the server refuses a list naming one (409 force_required).
async function repair(action, records, force) {
  const done = await call("records/repair", {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ action, records: records.map(shownOf), force: Boolean(force) }),
  });
  say(`${action}: ${done.applied} applied, ${done.skipped} skipped (changed since shown).`);
  await refresh();
  return done;
}

function actionsFor(r) {
  // idem's own records (a server's Snowflake worker lease): shown, never repaired.
  if (r.internal) return [];
  const out = [];
  if (r.kind === "unknown") out.push(["reopen", "Reopen"]);
  if (r.state === "stuck") out.push(["release", "Release"]);
  // An attempt whose lease runs may still be working: releasing it lets a retry run beside it.
  if (r.state === "in_progress") out.push(["release", "Release (still running)"]);
  out.push(["delete", "Delete"]);
  return out;
}

function actionButtons(r) {
  return actionsFor(r).map(([action, label]) => el("button", {
    type: "button",
    class: action === "delete" ? "danger" : "",
    "aria-label": `${label} ${r.key}`,
    on: { click: async () => {
      const running = r.state === "in_progress"
        ? " Its attempt is still in progress and may still be working: a retry let in beside it runs the work twice."
        : "";
      if (!confirm(`${label} the record ${r.key} (fence ${r.fence})?${running}`)) return;
      // The question named the running attempt: answering yes is the explicit force.
      try { await repair(action, [r], r.state === "in_progress"); } catch (e) { if (!(e instanceof Refused)) say(e.message, true); }
    } },
  }, label));
}

function table(node, columns, rows, empty) {
  node.replaceChildren();
  node.append(el("thead", {}, el("tr", {}, ...columns.map(([h]) => el("th", { scope: "col" }, h)))));
  const body = el("tbody");
  if (!rows.length) body.append(el("tr", {}, el("td", { colspan: columns.length, class: "muted" }, empty)));
  for (const r of rows) body.append(el("tr", {}, ...columns.map(([, f]) => el("td", {}, ...[].concat(f(r))))));
  node.append(body);
}

function keyLink(r) {
  return el("a", { href: "#", on: { click: (e) => { e.preventDefault(); show(r); } } }, r.key);
}

async function loadCounts() {
  const c = await call(`records/counts`);
  const dl = $("counts");
  dl.replaceChildren();
  for (const s of STATES) {
    dl.append(el("div", { class: `count ${s}`, "data-state": s },
      el("dt", {}, s.replace("_", " ")), el("dd", {}, String(c[s]))));
  }
  $("oldest").textContent = c.oldest_in_progress_seconds === null
    ? "No attempt in progress."
    : `The oldest attempt started ${Math.round(c.oldest_in_progress_seconds)} s ago.`;
  await loadHistory(c);
}

// The counts taken in the background, and `live` (counts just read) as the last point.
async function loadHistory(live) {
  const h = await call("records/history");
  $("every").textContent = h.every_seconds;
  drawChart(live ? h.samples.concat([{ at: Date.now(), ...live }]) : h.samples);
}

function drawChart(samples) {
  const svg = $("chart");
  svg.replaceChildren();
  const legend = $("legend");
  legend.replaceChildren();
  if (samples.length < 2) {
    const text = document.createElementNS("http://www.w3.org/2000/svg", "text");
    text.setAttribute("x", "300");
    text.setAttribute("y", "64");
    text.setAttribute("text-anchor", "middle");
    text.setAttribute("class", "empty");
    text.textContent = "The chart fills in as the server counts the records.";
    svg.append(text);
    return;
  }
  const t0 = samples[0].at, t1 = samples[samples.length - 1].at || t0 + 1;
  const max = Math.max(1, ...samples.flatMap((s) => STATES.map((k) => s[k])));
  const ns = "http://www.w3.org/2000/svg";
  for (const k of STATES) {
    const points = samples.map((s) =>
      `${((s.at - t0) / Math.max(1, t1 - t0)) * 600},${118 - (s[k] / max) * 112}`).join(" ");
    const line = document.createElementNS(ns, "polyline");
    line.setAttribute("points", points);
    line.setAttribute("fill", "none");
    line.setAttribute("stroke", COLOURS[k]);
    line.setAttribute("stroke-width", "2");
    line.setAttribute("vector-effect", "non-scaling-stroke");
    svg.append(line);
    // A style property set from script, which the page's policy allows (a style attribute
    // it does not).
    const item = el("li", {}, k.replace("_", " "));
    item.style.setProperty("--c", COLOURS[k]);
    legend.append(item);
  }
}

// Up to `n` records in `state`, following the cursor: a store that scans (Redis) may answer
// a short page and a cursor to go on from.
async function listUpTo(state, n) {
  const out = [];
  let after = null;
  for (let i = 0; i < 50; i++) {
    const q = new URLSearchParams({ state, limit: n });
    if (after) q.set("after", after);
    const page = await call(`records?${q}`);
    out.push(...page.records);
    after = page.next;
    if (!after || out.length >= n) break;
  }
  return out.slice(0, n);
}

async function loadAttention() {
  const cols = [["Key", keyLink], ["Scope", (r) => r.scope], ["Age", (r) => age(r.created_at)], ["", actionButtons]];
  table($("stuck"), cols, await listUpTo("stuck", 10), "None.");
  table($("unknown"), cols, await listUpTo("unknown", 10), "None.");
}

async function loadRecords() {
  const after = cursors[cursors.length - 1];
  const page = await call(`records?${filterQuery({ limit: PAGE, after })}`);
  table($("records"), [
    ["State", (r) => el("span", { class: `tag ${r.state}` }, r.state.replace("_", " "))],
    ["Holds", holds],
    ["Fence", (r) => String(r.fence)],
    ["Age", (r) => age(r.created_at)],
    ["Scope", (r) => r.scope],
    ["Namespace", (r) => r.namespace],
    ["Key", keyLink],
  ], page.records, "No records match.");
  $("next").disabled = !page.next;
  $("next").dataset.cursor = page.next || "";
  $("first").disabled = cursors.length === 1;
}

async function loadWorkers() {
  const page = await call("records?scope=idem.ids&limit=100");
  const workers = page.records.filter((r) => r.namespace.startsWith("snowflake."));
  table($("workers"), [
    ["Id space", (r) => r.namespace.slice("snowflake.".length)],
    ["Worker", (r) => r.key],
    ["State", (r) => r.state.replace("_", " ")],
    ["Lease ends", (r) => new Date(r.lease_expires_at).toLocaleTimeString()],
  ], workers, "No worker id leased.");
}

// Only `idem serve` issues segment ids; the gateway has no such endpoint and the section stays
// hidden.
async function loadSegments() {
  const res = await fetch(BASE + "segments", { headers: { authorization: `Bearer ${token}` } });
  if (res.status === 404) return;
  if (!res.ok) throw new Error(`segments: ${res.status}`);
  const body = await res.json();
  $("segments-section").hidden = false;
  table($("segments"), [
    ["Scope", (r) => r.scope],
    ["Tag", (r) => r.tag],
    ["Ids in memory", (r) => String(r.remaining)],
    ["Next range", (r) => String(r.step)],
    ["Runway", (r) => (r.runway_seconds === null ? "—" : `${Math.round(r.runway_seconds)} s`)],
    ["Fetching", (r) => (r.failing ? `failing: ${r.failing}` : "ok")],
  ], body.segments, "No tag in use.");
}

// Only `idem serve` on a store that keeps locks lists them; elsewhere the section stays hidden.
async function loadLocks() {
  const res = await fetch(BASE + "locks", { headers: { authorization: `Bearer ${token}` } });
  if (res.status === 404 || res.status === 501) return;
  if (!res.ok) throw new Error(`locks: ${res.status}`);
  const body = await res.json();
  $("locks-section").hidden = false;
  table($("locks"), [
    ["Name", (r) => r.name],
    ["Fence", (r) => String(r.fence)],
    ["Lease ends", (r) => new Date(r.expires_at).toLocaleTimeString()],
  ], body.locks, "No lock held.");
}

async function loadHealth() {
  const res = await fetch(BASE + "health");
  const h = await res.json().catch(() => ({}));
  $("store").textContent = h.store ? `store: ${h.store}` : "store: unreachable";
  const ul = $("health");
  ul.replaceChildren(el("li", { class: h.status === "ok" ? "ok" : "bad" }, `status: ${h.status || "down"}`));
  for (const [name, c] of Object.entries(h.components || {})) {
    const state = typeof c === "object" ? c.status : c;
    ul.append(el("li", { class: state === "ok" ? "ok" : "bad" }, `${name}: ${state}`));
  }
}

// Shows one record; `quiet` on a refresh, where a record deleted meanwhile just closes.
async function show(r, quiet) {
  const q = new URLSearchParams({ scope: r.scope, namespace: r.namespace, key: r.key });
  let rec;
  try { rec = await call(`records/show?${q}`); } catch (e) {
    if (quiet || e instanceof Refused) {
      current = null;
      $("detail").hidden = true;
    } else {
      say(e.message, true);
    }
    return;
  }
  current = rec;
  const dl = $("detail-fields");
  dl.replaceChildren();
  for (const k of ["scope", "namespace", "key", "state", "kind", "fence", "created_at", "updated_at",
    "lease_expires_at", "expires_at", "response_bytes"]) {
    dl.append(el("dt", {}, k), el("dd", {}, rec[k] === null ? "—" : String(rec[k])));
  }
  // Multi-step work: how far it got (outputs by size only).
  const steps = (rec.steps || [])
    .map((s) => (s.outcome === "done" ? `${s.step} (done, ${s.output_bytes} bytes)` : `${s.step} (unknown)`))
    .join(", ");
  dl.append(el("dt", {}, "steps"), el("dd", {}, steps || "—"));
  $("detail-actions").replaceChildren(...actionButtons(rec));
  const a = rec.answer;
  $("detail-answer").textContent = a
    ? `${a.status}\n${a.headers.map(([n, v]) => `${n}: ${v}`).join("\n")}\n\n${a.body === null ? `(${a.body_bytes} bytes, not text)` : a.body}${a.body_truncated ? "\n…" : ""}`
    : "No stored HTTP answer.";
  $("detail").hidden = false;
  $("detail-title").focus?.();
  $("detail").scrollIntoView({ block: "nearest" });
}

// The records `action` may touch among those the filter on screen matches: reopen takes
// unknown outcomes only, release stuck attempts unless the filter names a state it applies to.
// `null` when the filter's state leaves the action nothing.
function bulkQuery(action) {
  const state = applied.get("state");
  if (action === "reopen") {
    if (state && !["unknown", "completed"].includes(state)) return null;
    return filterQuery({ state: "unknown", limit: MAX_BULK });
  }
  if (action === "release") {
    if (["released", "expired"].includes(state)) return null;
    return filterQuery({ state: state || "stuck", limit: MAX_BULK });
  }
  return filterQuery({ limit: MAX_BULK });
}

async function bulk(action) {
  if (typedFilter().toString() !== applied.toString()) {
    say("The filter was changed but not applied: press Filter first. A bulk repair acts only on the records the table shows.", true);
    return;
  }
  if (action === "delete" && ![...applied.keys()].length) {
    say("Delete all matching… needs a filter: choose a scope, namespace, state or age, and press Filter.", true);
    return;
  }
  const q = bulkQuery(action);
  if (!q) { say(`The filter shown selects ${applied.get("state")} records; there are none to ${action}.`); return; }
  try {
    const all = [];
    let after = null;
    do {
      if (after) q.set("after", after);
      const page = await call(`records?${q}`);
      all.push(...page.records);
      after = page.next;
    } while (after && all.length <= MAX_BULK);
    if (all.length > MAX_BULK) { say(`More than ${MAX_BULK} records match: narrow the filter.`, true); return; }
    const own = all.filter((r) => r.internal);
    const records = all.filter((r) => !r.internal);
    if (!records.length) {
      say(own.length ? `Only idem's own records match (${own.length}); they are never repaired.` : `No records match; nothing to ${action}.`);
      return;
    }
    askBulk(action, q, records, own.length);
  } catch (e) { if (!(e instanceof Refused)) say(e.message, true); }
}

// Shows what a bulk repair will touch, counted by state, and asks; attempts in progress are
// called out and repaired only once their box is ticked.
function askBulk(action, q, records, own) {
  const byState = {};
  for (const r of records) byState[r.state] = (byState[r.state] || 0) + 1;
  const running = byState.in_progress || 0;
  q.delete("limit");
  q.delete("after");
  $("bulk-title").textContent = `${action[0].toUpperCase()}${action.slice(1)} ${records.length} records?`;
  $("bulk-filter").textContent = `Filter: ${describeFilter(q)}.`;
  $("bulk-states").replaceChildren(...Object.entries(byState).map(([s, n]) =>
    el("li", { "data-state": s }, `${n} ${s.replace("_", " ")}`)));
  $("bulk-own").hidden = !own;
  $("bulk-own").textContent = `${own} of idem's own records (scope idem.…) match too and are left out: they are never repaired.`;
  $("bulk-running").hidden = !running;
  $("bulk-force-label").textContent = `Also ${action} the ${running} attempts still in progress. They may still be working: a retry let in beside one runs the work twice.`;
  $("bulk-force").checked = false;
  const go = $("bulk-go");
  go.textContent = `${action[0].toUpperCase()}${action.slice(1)} ${records.length} records`;
  const ready = () => { go.disabled = running > 0 && !$("bulk-force").checked; };
  $("bulk-force").onchange = ready;
  ready();
  go.onclick = async () => {
    const force = running > 0 && $("bulk-force").checked;
    $("bulk-dialog").close();
    try { await repair(action, records, force); } catch (e) { if (!(e instanceof Refused)) say(e.message, true); }
  };
  $("bulk-dialog").showModal();
}

async function refresh() {
  try {
    await Promise.all([loadHealth(), loadCounts(), loadAttention(), loadRecords(), loadWorkers(), loadSegments(), loadLocks()]);
    if (current) await show(current, true);
  } catch (e) { if (!(e instanceof Refused)) say(e.message, true); }
}

function signOut(message) {
  token = null;
  sessionStorage.removeItem("idem-admin-token");
  $("app").hidden = true;
  $("sign-out").hidden = true;
  $("sign-in").hidden = false;
  if (message) say(message, true);
  $("token").focus();
}

async function signedIn() {
  say("");
  $("sign-in").hidden = true;
  $("app").hidden = false;
  $("sign-out").hidden = false;
  await refresh();
}

document.addEventListener("DOMContentLoaded", () => {
  $("sign-in-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    token = $("token").value.trim();
    sessionStorage.setItem("idem-admin-token", token);
    $("token").value = "";
    await signedIn();
  });
  $("sign-out").addEventListener("click", () => signOut());
  $("filter").addEventListener("submit", async (e) => {
    e.preventDefault();
    applied = typedFilter();
    cursors = [null];
    try { await loadRecords(); } catch (err) { if (!(err instanceof Refused)) say(err.message, true); }
  });
  $("next").addEventListener("click", async () => {
    cursors.push($("next").dataset.cursor);
    await loadRecords().catch((e) => say(e.message, true));
  });
  $("first").addEventListener("click", async () => {
    cursors = [null];
    await loadRecords().catch((e) => say(e.message, true));
  });
  for (const action of ["release", "reopen", "delete"]) {
    $(`bulk-${action}`).addEventListener("click", () => bulk(action));
  }
  $("bulk-cancel").addEventListener("click", () => $("bulk-dialog").close());
  if (token) signedIn(); else signOut();
  // The chart follows the server's own counts; it does not count again.
  setInterval(() => { if (token) loadHistory().catch(() => {}); }, 30000);
});
