// The handler wrapper in a real Express app and a real Fastify app, called over HTTP: the same
// checks for both.

import assert from "node:assert/strict";
import type { AddressInfo } from "node:net";
import { after, before, describe, test } from "node:test";

import express from "express";
import Fastify from "fastify";

import { Idem, IdemError, idempotent, type HandlerResult } from "../src/index.js";
import { KEYS, ns, serve, type Served } from "./server.js";

let server: Served | undefined;
before(async () => {
  server = await serve();
});
after(() => server?.stop());

/** The route under test: counts its runs per order id; fails, throws or dawdles on demand. */
function orders(runs: Record<string, number>) {
  return async (req: { body?: unknown }): Promise<HandlerResult> => {
    const body = req.body as { id: string; fail?: boolean; throw?: boolean; slow?: boolean; big?: boolean };
    const id = String(body.id);
    runs[id] = (runs[id] ?? 0) + 1;
    if (body.fail) return { status: 503, body: { error: "try again" } };
    if (body.big) return { status: 201, body: { order: id, pad: "x".repeat(2 << 20) } };
    if (body.throw) throw new Error("the handler failed");
    if (body.slow) await new Promise((r) => setTimeout(r, 500));
    return { status: 201, body: { order: id, run: runs[id] } };
  };
}

/** The wrapper's options: keys scoped to the `x-user` header's user. */
const options = (namespace: string) => ({
  namespace,
  required: true,
  scope: (req: { headers: Record<string, string | string[] | undefined> }) => req.headers["x-user"] as string | undefined,
});

/** Starts an app with `POST /orders` wrapped; its base URL and how to stop it. */
type Mount = (idem: Idem, namespace: string, runs: Record<string, number>) => Promise<{ base: string; close: () => Promise<void> }>;

const mountExpress: Mount = async (idem, namespace, runs) => {
  const web = express();
  web.use(express.json());
  web.post("/orders", idempotent(idem, options(namespace), orders(runs)));
  const app = await new Promise<ReturnType<typeof web.listen>>((ok) => {
    const listening = web.listen(0, "127.0.0.1", () => ok(listening));
  });
  const base = `http://127.0.0.1:${(app.address() as AddressInfo).port}`;
  return { base, close: () => new Promise((ok) => app.close(() => ok())) };
};

const mountFastify: Mount = async (idem, namespace, runs) => {
  const app = Fastify({ bodyLimit: 8 << 20 });
  app.post("/orders", idempotent(idem, options(namespace), orders(runs)));
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
      if (server) app = await mount(new Idem(server.url, { apiKey: KEYS.shop }), ns(), runs);
    });
    after(() => app?.close());

    const post = (body: unknown, key?: string, user = "ann") =>
      fetch(`${app!.base}/orders`, {
        method: "POST",
        headers: { "content-type": "application/json", "x-user": user, ...(key ? { "idempotency-key": key } : {}) },
        body: JSON.stringify(body),
      });

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
      assert.match(other.headers.get("content-type") ?? "", /^application\/problem\+json/);
      assert.equal((await other.json()).code, "fingerprint_mismatch");
      const none = await post({ id: "o-3" });
      assert.equal(none.status, 400);
      assert.equal((await none.json()).code, "idempotency_key_missing");
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
      assert.equal((await second.json()).code, "in_progress");
      assert.ok(second.headers.get("retry-after"));
      assert.equal((await first).status, 201);
      assert.equal(runs["o-8"], 1);
    });

    test("keys are the scope's own: two users with one key each run", async (t) => {
      if (!server) return t.skip("no idem serve");
      const ann = await post({ id: "o-s" }, "k-s", "ann");
      const bob = await post({ id: "o-s" }, "k-s", "bob");
      assert.deepEqual([ann.status, bob.status], [201, 201]);
      assert.equal(bob.headers.get("idempotent-replayed"), null);
      assert.equal(runs["o-s"], 2);
    });

    test("an answer too large to keep is given once; a retry is refused and runs nothing", async (t) => {
      if (!server) return t.skip("no idem serve");
      const first = await post({ id: "o-big", big: true }, "k-big");
      assert.equal(first.status, 201);
      assert.equal(((await first.json()) as { pad: string }).pad.length, 2 << 20);
      const again = await post({ id: "o-big", big: true }, "k-big");
      assert.equal(again.status, 409);
      assert.equal(((await again.json()) as { code: string }).code, "response_not_replayable");
      assert.equal(runs["o-big"], 1);
    });

    test("a storm of retries with one key runs the handler once", async (t) => {
      if (!server) return t.skip("no idem serve");
      // Retried as a client would on 409, until each has the answer.
      const call = async (): Promise<unknown> => {
        for (;;) {
          const answer = await post({ id: "o-storm", slow: true }, "k-storm");
          if (answer.status !== 409) return { status: answer.status, body: await answer.json() };
          await new Promise((r) => setTimeout(r, 50));
        }
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
    const req = { method: "POST", url: "/o", headers: { "idempotency-key": "k" }, body: {} };
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

  test("a body no parser read is refused, not fingerprinted as none", async () => {
    const idem = new Idem("http://idem", { fetch: async () => Response.json({}) });
    const req = { method: "POST", url: "/o", headers: { "idempotency-key": "k", "content-length": "12" } };
    await assert.rejects(idempotent(idem, { namespace: "n" }, () => ({ body: 1 }))(req, reply().r), /no body parser/);
  });
});
