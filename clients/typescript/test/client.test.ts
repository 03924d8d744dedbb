// The client against a real idem serve: once() under a storm, failures kept and released,
// steps resumed after a process is killed, leases kept alive, refusals, retries, ids, tokens
// and locks.

import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { appendFileSync, mkdtempSync, readFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";
import { createInterface } from "node:readline";
import { setTimeout as delay } from "node:timers/promises";

import { Idem, IdemError, LeaseLost, NOT_KEPT, PreviousFailure, PROBLEM_CODES } from "../src/index.js";
import { KEYS, ROOT, ns, serve, type Served } from "./server.js";

let server: Served | undefined;
let idem: Idem;

before(async () => {
  server = await serve();
  if (server) idem = new Idem(server.url, { apiKey: KEYS.shop });
});
after(() => server?.stop());

const live = (name: string, fn: () => Promise<void>) =>
  test(name, async (t) => {
    if (!server) return t.skip("no idem serve");
    await fn();
  });

describe("once", () => {
  live("a storm of calls on one key runs it once, and each gets its result", async () => {
    const namespace = ns();
    let runs = 0;
    const work = async () => {
      runs++;
      await new Promise((r) => setTimeout(r, 300));
      return { charge: `ch-${runs}` };
    };
    const results = await Promise.all(
      Array.from({ length: 20 }, () => idem.once("o-1", work, { namespace, request: { amount: 1 } })),
    );
    assert.equal(runs, 1);
    assert.deepEqual(results, Array(20).fill({ charge: "ch-1" }));
    await assert.rejects(
      idem.once("o-1", work, { namespace, request: { amount: 2 } }),
      (e) => IdemError.is(e, "fingerprint_mismatch"),
    );
  });

  live("a storm of 400 calls over 8 keys runs each key once", async () => {
    const namespace = ns();
    const runs = new Map<string, number>();
    const work = (key: string) => async () => {
      runs.set(key, (runs.get(key) ?? 0) + 1);
      await new Promise((r) => setTimeout(r, 100));
      return { key, run: runs.get(key) };
    };
    const calls = Array.from({ length: 400 }, (_, i) => {
      const key = `k-${i % 8}`;
      return idem.once(key, work(key), { namespace, request: { key } }).then((result) => ({ key, result }));
    });
    for (const { key, result } of await Promise.all(calls)) assert.deepEqual(result, { key, run: 1 });
    assert.deepEqual([...runs.values()], Array(8).fill(1));
  });

  live("a permanent failure is kept; any other releases the key", async () => {
    const namespace = ns();
    let declined = 0;
    const permanent = (e: unknown) => e instanceof RangeError;
    const decline = async () => {
      declined++;
      throw new RangeError("card declined");
    };
    await assert.rejects(idem.once("d", decline, { namespace, permanent }), RangeError);
    await assert.rejects(idem.once("d", decline, { namespace, permanent }), (e) => {
      assert.ok(e instanceof PreviousFailure);
      assert.equal(e.errorName, "RangeError");
      assert.equal(e.errorMessage, "card declined");
      return true;
    });
    assert.equal(declined, 1);
    let flaky = 0;
    const sometimes = async () => {
      if (++flaky === 1) throw new Error("timed out before sending");
      return "paid";
    };
    await assert.rejects(idem.once("f", sometimes, { namespace, permanent }));
    assert.equal(await idem.once("f", sometimes, { namespace, permanent }), "paid");
    assert.equal(await idem.once("f", sometimes, { namespace, permanent }), "paid");
    assert.equal(flaky, 2);
  });

  live("a lease is kept alive past its length while the work runs", async () => {
    const namespace = ns();
    const result = await idem.run("long", { namespace, lease: 1 }, async () => {
      await new Promise((r) => setTimeout(r, 2500));
      await assert.rejects(idem.begin(namespace, "long", { request: null }), (e) => IdemError.is(e, "in_progress"));
      return "kept";
    });
    assert.equal(result, "kept");
  });
});

describe("cancellation", () => {
  live("work aborted after its effect keeps its key: a retry does not run it, and the lease ends", async () => {
    const namespace = ns();
    let runs = 0;
    const charge = async (signal: AbortSignal) => {
      runs++; // the effect
      await delay(5_000, undefined, { signal }); // then waits on something that is aborted
      return "charged";
    };
    const caller = new AbortController();
    const first = idem.once("k", () => charge(caller.signal), { namespace, lease: 1 });
    await delay(100);
    caller.abort();
    await assert.rejects(first, { name: "AbortError" });
    await assert.rejects(
      idem.once("k", () => charge(new AbortController().signal), { namespace, wait: 0 }),
      (e) => IdemError.is(e, "in_progress"),
    );
    assert.equal(runs, 1);
    // Renewed no more, the lease ends: a later attempt takes the key over as after a crash.
    await delay(1_500);
    assert.equal((await idem.begin(namespace, "k")).outcome, "acquired");
  });

  live("a caller that stops waiting leaves the work to its end, and its result is kept", async () => {
    const namespace = ns();
    let runs = 0;
    const work = async () => {
      runs++;
      await delay(300);
      return "paid";
    };
    const caller = new AbortController();
    const first = idem.once("k", work, { namespace, signal: caller.signal });
    await delay(100);
    caller.abort(new Error("the caller hung up"));
    await assert.rejects(first, /the caller hung up/);
    assert.equal(await idem.once("k", work, { namespace }), "paid");
    assert.equal(runs, 1);
    await assert.rejects(idem.once("aborted", work, { namespace, signal: caller.signal }), /the caller hung up/);
    assert.equal(runs, 1);
  });
});

describe("results", () => {
  live("a call that returns nothing, and a step that returns nothing, run once", async () => {
    const namespace = ns();
    let runs = 0;
    const work = async () => {
      runs++;
    };
    assert.equal(await idem.once("nothing", work, { namespace }), null);
    assert.equal(await idem.once("nothing", work, { namespace }), null);
    assert.equal(runs, 1);
    let effects = 0;
    const result = await idem.run("steps", { namespace }, async (run) => {
      await run.step("log", () => {
        effects++;
      });
      return "ok";
    });
    assert.equal(result, "ok");
    assert.equal(effects, 1);
  });

  live("the first caller is given what every retry is: the result as JSON gives it back", async () => {
    const namespace = ns();
    let runs = 0;
    const work = () => {
      runs++;
      return { at: new Date(0), gone: undefined, list: [undefined, 1], order: { placed: new Date(1000) } };
    };
    const asKept = { at: "1970-01-01T00:00:00.000Z", list: [null, 1], order: { placed: "1970-01-01T00:00:01.000Z" } };
    assert.deepEqual(await idem.once<unknown>("dated", work, { namespace }), asKept);
    assert.deepEqual(await idem.once<unknown>("dated", work, { namespace }), asKept);
    assert.equal(runs, 1);
    const step = () => idem.run("stepped", { namespace }, (run) => run.step<unknown>("at", () => new Date(0)));
    assert.equal(await step(), "1970-01-01T00:00:00.000Z");
    assert.equal(await step(), "1970-01-01T00:00:00.000Z");
  });

  live("a result idem cannot store ran once and never runs again", async () => {
    const namespace = ns();
    let runs = 0;
    const huge = () => {
      runs++;
      return "x".repeat(2 << 20); // past the server's 1 MiB body limit
    };
    const bigint = () => {
      runs++;
      return { amount: 10n };
    };
    // JSON would keep these as {}: kept so, the first caller and a retry would be given different values.
    const map = () => {
      runs++;
      return { amounts: new Map([["eur", 10]]) };
    };
    const set = () => {
      runs++;
      return new Set(["a"]);
    };
    for (const [key, fn] of [["huge", huge], ["bigint", bigint], ["map", map], ["set", set]] as const) {
      for (let i = 0; i < 2; i++) {
        await assert.rejects(idem.once<unknown>(key, fn, { namespace }), (e) => e instanceof PreviousFailure && e.errorName === NOT_KEPT);
      }
    }
    assert.equal(runs, 4);
  });
});

describe("steps", () => {
  live("a process killed after each step is resumed each time without running it again", async () => {
    const namespace = ns();
    const effects = join(mkdtempSync(join(tmpdir(), "idem-ts-")), "effects");
    // Three workers in turn, each killed after recording one step: the next takes the key
    // over once the killed one's lease (1 s, renewed no more) ends, and does the next step.
    for (const expected of ["debit", "fee"]) {
      const child = spawn(process.execPath, [join(import.meta.dirname, "child.js"), server!.url, KEYS.shop, namespace, effects], {
        stdio: ["ignore", "pipe", "inherit"],
      });
      const line = await new Promise<string>((ok) => createInterface({ input: child.stdout! }).once("line", ok));
      assert.equal(line, expected);
      child.kill("SIGKILL");
    }
    const effect = (name: string) => {
      appendFileSync(effects, `${name}\n`);
      return { done: name };
    };
    const result = await idem.run("transfer-1", { namespace, request: { amount: 100 }, wait: 10 }, async (run) => {
      assert.equal(run.steps.get("debit")?.outcome, "done");
      assert.equal(run.steps.get("fee")?.outcome, "done");
      const debit = await run.step("debit", () => effect("debit"));
      const fee = await run.step("fee", () => effect("fee"));
      const credit = await run.step("credit", () => effect("credit"));
      return { debit, fee, credit };
    });
    assert.deepEqual(result, { debit: { done: "debit" }, fee: { done: "fee" }, credit: { done: "credit" } });
    assert.deepEqual(readFileSync(effects, "utf8").trim().split("\n"), ["debit", "fee", "credit"]);
  });

  live("a run sees that its key was taken over, and its result is not kept", async () => {
    const namespace = ns();
    await assert.rejects(
      idem.run("k", { namespace, lease: 0.6 }, async (run) => {
        assert.equal(run.lost, false);
        // Another attempt takes the key: this run's lease is given back behind its back.
        await idem.release(namespace, "k", run.lease);
        const other = await idem.begin(namespace, "k");
        assert.equal(other.outcome, "acquired");
        for (let i = 0; i < 100 && !run.lost; i++) await new Promise((r) => setTimeout(r, 50));
        assert.equal(run.lost, true); // seen by the renewal
        if (other.outcome === "acquired") await idem.complete(namespace, "k", other.lease, "the other's");
        return "mine";
      }),
      LeaseLost,
    );
    assert.equal((await idem.record(namespace, "k"))?.response, "the other's");
  });
});

describe("errors", () => {
  test("every code of the catalogue is a ProblemCode", () => {
    const table = [...readFileSync(join(ROOT, "README.md"), "utf8").matchAll(/^\| \d{3} \| `([a-z_]+)` \|/gm)].map((m) => m[1]);
    assert.ok(table.length > 50);
    assert.deepEqual([...PROBLEM_CODES].sort(), [...new Set(table)].sort());
  });

  test("idem's own calls are retried while the store is unavailable, and no more", async () => {
    let calls = 0;
    const answers = [
      Response.json({ code: "store_unavailable", detail: "down", retry_after_ms: 10 }, { status: 503 }),
      Response.json({ code: "store_unavailable", detail: "down" }, { status: 503 }),
      Response.json({ ids: ["01a1fdca-467a-7000-8015-a20556160a95"] }),
    ];
    const fake: typeof fetch = async () => answers[calls++]!;
    assert.deepEqual(await new Idem("http://idem", { fetch: fake }).uuid7(), ["01a1fdca-467a-7000-8015-a20556160a95"]);
    assert.equal(calls, 3);
    let refused = 0;
    const conflict: typeof fetch = async () => {
      refused++;
      return Response.json({ code: "in_progress", detail: "held" }, { status: 409 });
    };
    await assert.rejects(new Idem("http://idem", { fetch: conflict }).begin("n", "k"), (e) => IdemError.is(e, "in_progress"));
    assert.equal(refused, 1);
    const down: typeof fetch = async () => {
      throw new TypeError("fetch failed");
    };
    await assert.rejects(new Idem("http://idem", { fetch: down, attempts: 2 }).uuid7(), (e) => IdemError.is(e, "unreachable"));
  });

  live("refusals carry their codes; keys are the caller's own", async () => {
    const namespace = ns();
    await assert.rejects(idem.begin(namespace, "k".repeat(300)), (e) => IdemError.is(e, "invalid_key"));
    await assert.rejects(new Idem(server!.url, { apiKey: "nobody" }).begin(namespace, "k"), (e) => IdemError.is(e, "unauthorized"));
    const bank = new Idem(server!.url, { apiKey: KEYS.bank });
    assert.equal(await idem.once("same", () => "shop's", { namespace }), "shop's");
    assert.equal(await bank.once("same", () => "bank's", { namespace }), "bank's");
  });
});

describe("ids, tokens and locks", () => {
  live("ids, a token used once, a lock's fence", async () => {
    assert.equal((await idem.uuid7(3)).length, 3);
    assert.equal((await idem.snowflake(2)).length, 2);
    const token = await idem.issueToken("form", 60);
    await idem.consumeToken(token, "form");
    await assert.rejects(idem.consumeToken(token, "form"), (e) => IdemError.is(e, "already_used"));
    const name = ns();
    const fence = await idem.withLock(name, { lease: 5 }, async (lock) => {
      await assert.rejects(idem.withLock(name, {}, () => 0), (e) => IdemError.is(e, "lock_held"));
      return lock.fence;
    });
    assert.ok(fence > 0);
  });
});

describe("values JSON cannot hold", () => {
  live("NaN and Infinity are refused, not sent as null; a Map or a Set, not sent as {}", async () => {
    const namespace = ns();
    let runs = 0;
    for (const amount of [NaN, Infinity, new Map([["eur", 1]]), new Set([1])]) {
      await assert.rejects(idem.once("k", () => ++runs, { namespace, request: { amount } }), TypeError);
    }
    assert.equal(runs, 0);
  });

  live("a step whose output cannot be recorded ends the run, never to run again", async () => {
    const namespace = ns();
    let effects = 0;
    for (let i = 0; i < 2; i++) {
      await assert.rejects(
        idem.run("k", { namespace }, async (run) => {
          await run.step("big", () => {
            effects++;
            return { amount: 10n };
          });
          return "done";
        }),
        (e) => e instanceof PreviousFailure && e.errorName === NOT_KEPT,
      );
    }
    assert.equal(effects, 1);
  });

  live("a lock is waited for past the call timeout", async () => {
    const name = ns();
    const quick = new Idem(server!.url, { apiKey: KEYS.shop, timeoutMs: 1000 });
    const first = quick.withLock(name, { lease: 5 }, () => new Promise((r) => setTimeout(r, 2000)));
    await new Promise((r) => setTimeout(r, 200));
    const fence = await quick.withLock(name, { lease: 5, wait: 4 }, (lock) => lock.fence);
    await first;
    assert.ok(fence > 0);
  });
});

describe("renewals", () => {
  test("a run has at most one renewal in flight, however slow", async () => {
    let inFlight = 0;
    let most = 0;
    let renewals = 0;
    const fake: typeof fetch = async (input, init) => {
      const path = new URL(String(input)).pathname;
      if (path === "/v1/records/begin") {
        const lease = { id: "1.k", fence: 1, expires_at: "2030-01-01T00:00:00Z" };
        return Response.json({ outcome: "acquired", lease, steps: [] });
      }
      if (path === "/v1/records/renew") {
        renewals++;
        most = Math.max(most, ++inFlight);
        await new Promise((r) => setTimeout(r, 700)); // slower than a beat
        inFlight--;
        return Response.json({ lease: JSON.parse(String(init?.body)) });
      }
      return Response.json({});
    };
    const idem = new Idem("http://idem", { fetch: fake });
    // Beats every 100 ms for 1 s, each renewal taking 700 ms.
    await idem.run("k", { namespace: "n", lease: 0.3 }, () => new Promise((r) => setTimeout(r, 1000)));
    assert.ok(renewals >= 1);
    assert.equal(most, 1);
  });
});
