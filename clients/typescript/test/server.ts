// Starts a real `idem serve` (the workspace's build, or IDEM_BIN) on the memory store with two
// callers, for the tests.

import { spawn, type ChildProcess } from "node:child_process";
import { existsSync, mkdtempSync, writeFileSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";

export const ROOT = resolve(import.meta.dirname, "../../../..");
export const KEYS = { shop: "shop-key-0123456789abcdef", bank: "bank-key-0123456789abcdef" };

function binary(): string | undefined {
  if (process.env.IDEM_BIN) return process.env.IDEM_BIN;
  const target = process.env.CARGO_TARGET_DIR ?? join(ROOT, "target");
  return ["debug", "release"].map((b) => join(target, b, "idem")).find((p) => existsSync(p));
}

async function freePort(): Promise<number> {
  return new Promise((ok, fail) => {
    const s = createServer();
    s.listen(0, "127.0.0.1", () => {
      const address = s.address();
      s.close(() => (typeof address === "object" && address ? ok(address.port) : fail(new Error("no port"))));
    });
  });
}

export interface Served {
  url: string;
  stop(): void;
}

/** `undefined` (with a note) when there is no binary, unless CI=true, where that fails. */
export async function serve(): Promise<Served | undefined> {
  const bin = binary();
  if (!bin) {
    const why = "no idem binary: build it (cargo build -p idem-server) or set IDEM_BIN";
    if (process.env.CI === "true") throw new Error(why);
    console.log(`# skipped: ${why}`);
    return undefined;
  }
  const dir = mkdtempSync(join(tmpdir(), "idem-ts-"));
  writeFileSync(join(dir, "keys"), Object.entries(KEYS).map(([s, k]) => `${s} ${k}\n`).join(""));
  const port = await freePort();
  const child: ChildProcess = spawn(
    bin,
    ["serve", "--store", "memory://", "--listen", `127.0.0.1:${port}`, "--api-keys", join(dir, "keys")],
    { stdio: "ignore" },
  );
  const url = `http://127.0.0.1:${port}`;
  const deadline = Date.now() + 30_000;
  for (;;) {
    try {
      if ((await fetch(`${url}/healthz`)).ok) break;
    } catch {
      // not listening yet
    }
    if (child.exitCode !== null || Date.now() > deadline) throw new Error("idem serve did not start");
    await new Promise((r) => setTimeout(r, 50));
  }
  return { url, stop: () => child.kill("SIGKILL") };
}

let n = 0;
/** A namespace of the test's own. */
export function ns(): string {
  return `ts-${process.pid}-${Date.now()}-${n++}`;
}
