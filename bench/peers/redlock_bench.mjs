// Peer benchmark: npm `redlock` (v5) over `ioredis`, single Redis node.
//
// Every lock client is an async loop in this one process with its own ioredis
// connection and its own Redlock instance (quorum of 1). Scenarios:
//   uncontended, clients=1 and 8: each client acquires/releases its OWN lock
//     (lease 10 s) as fast as it can.
//   contended, clients=8: all clients acquire (retrying forever) and release
//     ONE shared lock. Hand-off latency = time from the releasing client
//     starting release() to a DIFFERENT client's acquire() returning, paired
//     through a shared event log on process.hrtime.bigint().
// Each scenario runs for DURATION seconds. `pairs` counts acquire+release
// pairs whose release returned before the deadline and `seconds` is that
// window; clients still waiting at the deadline get the lock once more and
// then stop, outside the window.
// Peers: "redlock" = defaults but retryCount -1 (retry forever, retryDelay
// 200 ms); "redlock-tuned" = also retryDelay 5 ms, retryJitter 5 ms.
// Output: one JSON line per scenario on stdout (plus a hand-off count on stderr).
//
// Env: REDIS_URL (redis://127.0.0.1:6379), DURATION (5),
//      IDEM_PEERS_DIR (where run.sh installed node_modules).
import { createRequire } from "node:module";
import { homedir } from "node:os";
import { join } from "node:path";
import { setImmediate } from "node:timers/promises";

const peersDir = process.env.IDEM_PEERS_DIR ?? join(homedir(), ".cache/idem/peers");
const require = createRequire(join(peersDir, "package.json"));
const Redlock = require("redlock").default;
const Redis = require("ioredis");

const REDIS_URL = process.env.REDIS_URL ?? "redis://127.0.0.1:6379";
const DURATION = Number(process.argv[2] ?? process.env.DURATION ?? 5);
const PREFIX = "idem-peer-bench:";
const LEASE_MS = 10_000;
const now = () => process.hrtime.bigint();

const PEERS = {
  redlock: { retryCount: -1 },
  "redlock-tuned": { retryCount: -1, retryDelay: 5, retryJitter: 5 },
};

function pct(sorted, p) {
  if (sorted.length === 0) return null;
  const i = Math.min(sorted.length - 1, Math.ceil(p * sorted.length) - 1);
  return Math.round(sorted[Math.max(0, i)] * 10) / 10;
}

async function withClients(n, settings, fn) {
  const conns = Array.from({ length: n }, () => new Redis(REDIS_URL));
  try {
    await Promise.all(conns.map((c) => c.ping()));
    return await fn(conns.map((c) => new Redlock([c], settings)));
  } finally {
    conns.forEach((c) => c.disconnect());
  }
}

async function uncontended(peer, clients) {
  return withClients(clients, PEERS[peer], async (locks) => {
    const start = now();
    const deadline = start + BigInt(Math.round(DURATION * 1e9));
    let pairs = 0;
    await Promise.all(locks.map(async (redlock, id) => {
      const name = `${PREFIX}${peer}:uncontended:${clients}:${id}`;
      while (now() < deadline) {
        const lock = await redlock.acquire([name], LEASE_MS);
        await redlock.release(lock);
        if (now() <= deadline) pairs++;
      }
    }));
    return report(peer, "uncontended", clients, pairs, start, deadline, null);
  });
}

async function contended(peer, clients) {
  return withClients(clients, PEERS[peer], async (locks) => {
    const name = `${PREFIX}${peer}:contended`;
    const events = []; // [t, kind, client]; kind "rel" = release start, "acq" = acquire return
    let holder = null;
    const start = now();
    const deadline = start + BigInt(Math.round(DURATION * 1e9));
    let pairs = 0;
    await Promise.all(locks.map(async (redlock, id) => {
      while (now() < deadline) {
        const lock = await redlock.acquire([name], LEASE_MS);
        events.push([now(), "acq", id]);
        if (holder !== null) throw new Error(`mutual exclusion violated: client ${id} acquired while client ${holder} holds the lock`);
        holder = id;
        await setImmediate(); // let other clients' pending replies run, so the check can bite
        if (holder !== id) throw new Error(`mutual exclusion violated: client ${holder} took the lock from client ${id}`);
        holder = null;
        events.push([now(), "rel", id]);
        await redlock.release(lock);
        if (now() <= deadline) pairs++;
      }
    }));
    return report(peer, "contended", clients, pairs, start, deadline, handoffs(events, deadline));
  });
}

// Pair each acquisition with the latest release before it; keep cross-client ones.
function handoffs(events, deadline) {
  events.sort((a, b) => (a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : 0));
  const us = [];
  let lastRel = null;
  for (const [t, kind, id] of events) {
    if (kind === "rel") lastRel = [t, id];
    else if (lastRel && lastRel[1] !== id && t <= deadline) us.push(Number(t - lastRel[0]) / 1000);
  }
  return us.sort((a, b) => a - b);
}

function report(peer, scenario, clients, pairs, start, deadline, handoffUs) {
  const seconds = Number(deadline - start) / 1e9;
  const line = {
    peer, scenario, clients, pairs,
    seconds: Math.round(seconds * 1000) / 1000,
    pairs_per_s: Math.round((pairs / seconds) * 10) / 10,
    handoff_p50_us: handoffUs ? pct(handoffUs, 0.5) : null,
    handoff_p99_us: handoffUs ? pct(handoffUs, 0.99) : null,
  };
  console.log(JSON.stringify(line));
  if (handoffUs) console.error(`# ${peer} ${scenario}: ${handoffUs.length} cross-client hand-offs in ${pairs} pairs`);
}

async function cleanup() {
  const c = new Redis(REDIS_URL);
  try {
    let cursor = "0";
    do {
      const [next, keys] = await c.scan(cursor, "MATCH", `${PREFIX}*`, "COUNT", 1000);
      if (keys.length) await c.del(...keys);
      cursor = next;
    } while (cursor !== "0");
  } finally {
    c.disconnect();
  }
}

let failed = false;
try {
  await cleanup();
  await uncontended("redlock", 1);
  await uncontended("redlock", 8);
  await contended("redlock", 8);
  await contended("redlock-tuned", 8);
} catch (err) {
  console.error(`redlock_bench: ${err.message}`);
  failed = true;
} finally {
  await cleanup();
}
process.exit(failed ? 1 : 0);
