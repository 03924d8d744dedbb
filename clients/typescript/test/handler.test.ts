// The handler wrapper in a real Express app and a real Fastify app, called over HTTP: the same
// checks for both.

import assert from "node:assert/strict";
import type { AddressInfo } from "node:net";
import { after, before, describe, test } from "node:test";
import { setTimeout as delay } from "node:timers/promises";

import express from "express";
import Fastify from "fastify";

import { Idem, IdemError, idempotent, type HandlerOptions, type HandlerResult, type RequestLike } from "../src/index.js";
import { KEYS, ns, serve, type Served } from "./server.js";

let server: Served | undefined;
before(async () => {
  server = await serve();
});
after(() => server?.stop());

/** The route under test: counts its runs per order id; fails, throws, dawdles or is aborted on
 * demand. */
function orders(runs: Record<string, number>) {
  return async (req: { body?: unknown }): Promise<HandlerResult> => {
    const body = req.body as { id: string; fail?: boolean; throw?: boolean; slow?: boolean; big?: boolean; abort?: boolean };
    const id = String(body.id);
    runs[id] = (runs[id] ?? 0) + 1;
    if (body.fail) return { status: 503, body: { error: "try again" } };
    if (body.big) return { status: 201, body: { order: id, pad: "x".repeat(2 << 20) } };
    if (body.throw) throw new Error("the handler failed");
    // After its effect, a call of its own that times out (an AbortError).
    if (body.abort) await delay(5_000, undefined, { signal: AbortSignal.timeout(50) });
    if (body.slow) await new Promise((r) => setTimeout(r, 500));
    return { status: 201, body: { order: id, run: runs[id] } };
  };
}

/** The app's routes, each `POST` and wrapped: `/orders` with the default (each caller's keys its
 * own, by its Authorization header), `/users` with the app's `scope` (the `x-user` header), and
 * `/shared`, whose anonymous callers share their keys. */
const routes = (): [string, HandlerOptions<RequestLike>][] => [
  ["/orders", { namespace: ns(), required: true }],
  ["/users", { namespace: ns(), scope: (req) => req.headers["x-user"] as string | undefined }],
  ["/shared", { namespace: ns(), anonymous: "shared" }],
];

/** Starts an app with the routes; its base URL and how to stop it. */
type Mount = (idem: Idem, runs: Record<string, number>) => Promise<{ base: string; close: () => Promise<void> }>;

const mountExpress: Mount = async (idem, runs) => {
  const web = express();
  web.use(express.json());
  for (const [path, options] of routes()) web.post(path, idempotent(idem, options, orders(runs)));
  const app = await new Promise<ReturnType<typeof web.listen>>((ok) => {
    const listening = web.listen(0, "127.0.0.1", () => ok(listening));
  });
  const base = `http://127.0.0.1:${(app.address() as AddressInfo).port}`;
  return { base, close: () => new Promise((ok) => app.close(() => ok())) };
};

const mountFastify: Mount = async (idem, runs) => {
  const app = Fastify({ bodyLimit: 8 << 20 });
  for (const [path, options] of routes()) app.post(path, idempotent(idem, options, orders(runs)));
  const base = await app.listen({ port: 0, host: "127.0.0.1" });
  return { base, close: () => app.close() };
};

for (const [framework, mount] of [
  ["Express", mountExpress],
  ["Fastify", mountFastify],
] as const) {
  describe(`${framework}: idempotent()`, () => {
    const runs: Record<string, number> = {};
    let app: { base: string; close: () => Promise<void> } | undefined;
    before(async () => {
      if (server) app = await mount(new Idem(server.url, { apiKey: KEYS.shop }), runs);
    });
    after(() => app?.close());

    /** A POST as `user` (its `Authorization: Bearer` and its `x-user`; `null`: no one). */
    const post = (
      body: unknown,
      key?: string,
      { user = "ann" as string | null, path = "/orders", headers = {} as Record<string, string>, signal = undefined as AbortSignal | undefined } = {},
    ) =>
      fetch(`${app!.base}${path}`, {
        method: "POST",
        headers: {
          "content-type": "application/json",
          ...(user === null ? {} : { authorization: `Bearer ${user}`, "x-user": user }),
          ...(key === undefined ? {} : { "idempotency-key": key }),
          ...headers,
        },
        body: JSON.stringify(body),
        signal,
      });
    /** The POST retried as a client would on 409, until it has an answer. */
    const answered = async (body: unknown, key: string) => {
      for (;;) {
        const answer = await post(body, key);
        if (answer.status !== 409) return answer;
        await new Promise((r) => setTimeout(r, 50));
      }
    };
    const code = async (answer: Response) => {
      assert.match(answer.headers.get("content-type") ?? "", /^application\/problem\+json/);
      return ((await answer.json()) as { code: string }).code;
    };

    test("a retry with the key is given the first answer, marked replayed", async (t) => {
      if (!server) return t.skip("no idem serve");
      const first = await post({ id: "o-1" }, "k-1");
      assert.equal(first.status, 201);
      assert.equal(first.headers.get("idempotent-replayed"), null);
      const again = await post({ id: "o-1" }, "k-1");
      assert.equal(again.status, 201);
      assert.equal(again.headers.get("idempotent-replayed"), "true");
      assert.deepEqual(await again.json(), await first.json());
      assert.equal(runs["o-1"], 1);
      const other = await post({ id: "o-2" }, "k-1");
      assert.equal(other.status, 422);
      assert.equal(await code(other), "fingerprint_mismatch");
      const none = await post({ id: "o-3" });
      assert.equal(none.status, 400);
      assert.equal(await code(none), "idempotency_key_missing");
      assert.equal(runs["o-3"], undefined);
    });

    test("a 5xx answer is not kept: the retry runs again", async (t) => {
      if (!server) return t.skip("no idem serve");
      assert.equal((await post({ id: "o-9", fail: true }, "k-9")).status, 503);
      assert.equal((await post({ id: "o-9", fail: true }, "k-9")).status, 503);
      assert.equal(runs["o-9"], 2);
    });

    test("a handler that throws releases the key; a retry while one runs is 409", async (t) => {
      if (!server) return t.skip("no idem serve");
      assert.equal((await post({ id: "o-7", throw: true }, "k-7")).status, 500);
      assert.equal((await post({ id: "o-7", throw: true }, "k-7")).status, 500);
      assert.equal(runs["o-7"], 2);
      const first = post({ id: "o-8", slow: true }, "k-8");
      await new Promise((r) => setTimeout(r, 150));
      const second = await post({ id: "o-8", slow: true }, "k-8");
      assert.equal(second.status, 409);
      assert.equal(await code(second), "in_progress");
      assert.ok(second.headers.get("retry-after"));
      assert.equal((await first).status, 201);
      assert.equal(runs["o-8"], 1);
    });

    test("keys are each caller's own: another caller sending the key is never given the first's answer", async (t) => {
      if (!server) return t.skip("no idem serve");
      for (const path of ["/orders", "/users"]) {
        const id = `o-own${path}`;
        const alice = await post({ id }, "k-own", { user: "alice", path });
        const mallory = await post({ id }, "k-own", { user: "mallory", path });
        assert.deepEqual([alice.status, mallory.status], [201, 201]);
        assert.equal(mallory.headers.get("idempotent-replayed"), null);
        assert.deepEqual(await mallory.json(), { order: id, run: 2 });
        const again = await post({ id }, "k-own", { user: "alice", path });
        assert.equal(again.headers.get("idempotent-replayed"), "true");
        assert.deepEqual(await again.json(), await alice.json());
        assert.equal(runs[id], 2);
      }
      // The scheme is case-insensitive: the same credential, the same caller.
      const lower = await post({ id: "o-own/orders" }, "k-own", { user: null, headers: { authorization: "bearer alice" } });
      assert.equal(lower.headers.get("idempotent-replayed"), "true");
    });

    test("a keyed request from no one is 401 credential_required, unless the route shares", async (t) => {
      if (!server) return t.skip("no idem serve");
      for (const path of ["/orders", "/users"]) {
        const refused = await post({ id: "o-anon" }, "k-anon", { user: null, path });
        assert.equal(refused.status, 401);
        assert.equal(await code(refused), "credential_required");
      }
      const blank = await post({ id: "o-anon" }, "k-anon", { user: null, headers: { authorization: " " } });
      assert.equal(blank.status, 401);
      assert.equal(runs["o-anon"], undefined);
      // A route that says "shared": anonymous callers share their keys; a known one keeps its own.
      assert.equal((await post({ id: "o-anon" }, "k-anon", { user: null, path: "/shared" })).status, 201);
      const shared = await post({ id: "o-anon" }, "k-anon", { user: null, path: "/shared" });
      assert.equal(shared.headers.get("idempotent-replayed"), "true");
      const known = await post({ id: "o-anon" }, "k-anon", { path: "/shared" });
      assert.equal(known.headers.get("idempotent-replayed"), null);
      assert.equal(runs["o-anon"], 2);
    });

    test("a key of 255 characters is accepted, bare or quoted as the IETF draft writes it, as one key", async (t) => {
      if (!server) return t.skip("no idem serve");
      const key = "k".repeat(254) + '"';
      const bare = await post({ id: "o-long" }, key);
      assert.equal(bare.status, 201);
      const quoted = await post({ id: "o-long" }, `"${"k".repeat(254)}\\""; trace=1`);
      assert.equal(quoted.status, 201);
      assert.equal(quoted.headers.get("idempotent-replayed"), "true");
      assert.equal(runs["o-long"], 1);
      for (const refused of ["k".repeat(256), "a,b", '"a b"']) {
        const answer = await post({ id: "o-long" }, refused);
        assert.equal(answer.status, 400);
        assert.equal(await code(answer), "idempotency_key_invalid");
      }
      assert.equal(runs["o-long"], 1);
    });

    test("a keyed request whose body no parser read is 415, and runs nothing", async (t) => {
      if (!server) return t.skip("no idem serve");
      const form = await fetch(`${app!.base}/orders`, {
        method: "POST",
        headers: { "content-type": "application/x-www-form-urlencoded", authorization: "Bearer ann", "idempotency-key": "k-form" },
        body: "id=o-form",
      });
      // Fastify answers it itself: it has no parser for the type.
      assert.equal(form.status, 415);
      if (framework === "Express") assert.equal(await code(form), "unsupported_media_type");
      assert.equal(runs["o-form"], undefined);
    });

    test("a handler aborted after its effect keeps the key: a retry does not run it again", async (t) => {
      if (!server) return t.skip("no idem serve");
      assert.equal((await post({ id: "o-abort", abort: true }, "k-abort")).status, 500);
      const retry = await post({ id: "o-abort", abort: true }, "k-abort");
      assert.equal(retry.status, 409);
      assert.equal(await code(retry), "in_progress");
      assert.equal(runs["o-abort"], 1);
    });

    test("a caller that hangs up leaves the handler to its end: the retry is given its answer", async (t) => {
      if (!server) return t.skip("no idem serve");
      const hangUp = new AbortController();
      const first = post({ id: "o-gone", slow: true }, "k-gone", { signal: hangUp.signal });
      await new Promise((r) => setTimeout(r, 150));
      hangUp.abort();
      await assert.rejects(first);
      const retry = await answered({ id: "o-gone", slow: true }, "k-gone");
      assert.equal(retry.status, 201);
      assert.equal(retry.headers.get("idempotent-replayed"), "true");
      assert.equal(runs["o-gone"], 1);
    });

    test("an answer too large to keep is given once; a retry is refused and runs nothing", async (t) => {
      if (!server) return t.skip("no idem serve");
      const first = await post({ id: "o-big", big: true }, "k-big");
      assert.equal(first.status, 201);
      assert.equal(((await first.json()) as { pad: string }).pad.length, 2 << 20);
      const again = await post({ id: "o-big", big: true }, "k-big");
      assert.equal(again.status, 409);
      assert.equal(await code(again), "response_not_replayable");
      assert.equal(runs["o-big"], 1);
    });

    test("a storm of retries with one key runs the handler once", async (t) => {
      if (!server) return t.skip("no idem serve");
      const call = async (): Promise<unknown> => {
        const answer = await answered({ id: "o-storm", slow: true }, "k-storm");
        return { status: answer.status, body: await answer.json() };
      };
      const answers = await Promise.all(Array.from({ length: 40 }, call));
      assert.equal(runs["o-storm"], 1);
      for (const answer of answers) assert.deepEqual(answer, { status: 201, body: { order: "o-storm", run: 1 } });
    });
  });
}

describe("idempotent() without a framework", () => {
  const reply = () => {
    const sent: { status?: number; headers: Record<string, string>; body?: unknown } = { headers: {} };
    const r = {
      status(code: number) {
        sent.status = code;
        return r;
      },
      header(name: string, value: string) {
        sent.headers[name] = value;
        return r;
      },
      send(body: unknown) {
        sent.body = body;
      },
    };
    return { r, sent };
  };

  test("idem unavailable is 503 with Retry-After; idem refusing this service is a server error", async () => {
    const down = new Idem("http://idem", {
      attempts: 1,
      fetch: async () => Response.json({ code: "store_unavailable", detail: "down" }, { status: 503 }),
    });
    const req = { method: "POST", url: "/o", headers: { "idempotency-key": "k", authorization: "Bearer ann" }, body: {} };
    const { r, sent } = reply();
    let ran = 0;
    await idempotent(down, { namespace: "n" }, () => ({ body: ++ran }))(req, r);
    assert.equal(sent.status, 503);
    assert.equal(sent.headers["retry-after"], "1");
    assert.equal(ran, 0);
    const refused = new Idem("http://idem", {
      fetch: async () => Response.json({ code: "unauthorized", detail: "no such key" }, { status: 401 }),
    });
    await assert.rejects(idempotent(refused, { namespace: "n" }, () => ({ body: 1 }))(req, reply().r), (e) =>
      IdemError.is(e, "unauthorized"),
    );
  });

  test("a body no parser read is 415, not fingerprinted as none", async () => {
    const idem = new Idem("http://idem", { fetch: async () => Response.json({}) });
    const req = { method: "POST", url: "/o", headers: { "idempotency-key": "k", authorization: "Bearer ann", "content-length": "12" } };
    const { r, sent } = reply();
    await idempotent(idem, { namespace: "n" }, () => ({ body: 1 }))(req, r);
    assert.equal(sent.status, 415);
    assert.equal(sent.headers["content-type"], "application/problem+json");
    assert.equal(JSON.parse(String(sent.body)).code, "unsupported_media_type");
  });

  test("idem is sent the key whole, under a namespace with a hash of the caller, never the credential", async () => {
    const sentToIdem: string[] = [];
    const idem = new Idem("http://idem", {
      fetch: async (_url, init) => {
        sentToIdem.push(String(init?.body));
        const lease = { id: "1.k", fence: 1, expires_at: "2030-01-01T00:00:00Z" };
        return Response.json({ outcome: "acquired", lease, steps: [] });
      },
    });
    const key = "k".repeat(255);
    const secret = "Bearer sk-live-alice-0123456789";
    const req = { method: "POST", url: "/o", headers: { "idempotency-key": key, authorization: secret }, body: {} };
    await idempotent(idem, { namespace: "orders" }, () => ({ body: 1 }))(req, reply().r);
    const begin = JSON.parse(sentToIdem[0]!) as { namespace: string; key: string };
    assert.equal(begin.key, key);
    assert.match(begin.namespace, /^orders:[0-9a-f]{32}$/);
    for (const body of sentToIdem) assert.ok(!body.includes("alice"));
    assert.throws(() => idempotent(idem, { namespace: "n".repeat(96) }, () => ({ body: 1 })), TypeError);
  });
});
