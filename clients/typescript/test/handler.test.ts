// The Express wrapper in a real Express app, called over HTTP.

import assert from "node:assert/strict";
import type { AddressInfo } from "node:net";
import { after, before, test } from "node:test";

import express from "express";

import { Idem, idempotent } from "../src/index.js";
import { KEYS, ns, serve, type Served } from "./server.js";

let server: Served | undefined;
let app: ReturnType<typeof express.application.listen> | undefined;
let base = "";
const runs: Record<string, number> = {};

before(async () => {
  server = await serve();
  if (!server) return;
  const idem = new Idem(server.url, { apiKey: KEYS.shop });
  const web = express();
  web.use(express.json());
  const namespace = ns();
  web.post(
    "/orders",
    idempotent(idem, { namespace, required: true }, async (req: express.Request) => {
      const id = String(req.body.id);
      runs[id] = (runs[id] ?? 0) + 1;
      if (req.body.fail) return { status: 503, body: { error: "try again" } };
      if (req.body.throw) throw new Error("the handler failed");
      if (req.body.slow) await new Promise((r) => setTimeout(r, 500));
      return { status: 201, body: { order: id, run: runs[id] } };
    }),
  );
  await new Promise<void>((ok) => {
    app = web.listen(0, "127.0.0.1", () => ok());
  });
  base = `http://127.0.0.1:${(app!.address() as AddressInfo).port}`;
});
after(() => {
  app?.close();
  server?.stop();
});

const post = (body: unknown, key?: string) =>
  fetch(`${base}/orders`, {
    method: "POST",
    headers: { "content-type": "application/json", ...(key ? { "idempotency-key": key } : {}) },
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
