// The example of the docs runs, and shows what it says.

import assert from "node:assert/strict";
import { execFile } from "node:child_process";
import { join } from "node:path";
import { promisify } from "node:util";
import { after, before, test } from "node:test";

import { KEYS, serve, type Served } from "./server.js";

let server: Served | undefined;
before(async () => {
  server = await serve();
});
after(() => server?.stop());

test("the orders example charges once", async (t) => {
  if (!server) return t.skip("no idem serve");
  const example = join(import.meta.dirname, "..", "examples", "orders.js");
  const { stdout } = await promisify(execFile)(process.execPath, [example, server.url, KEYS.shop]);
  assert.match(stdout, /charged 1 time\(s\)/);
  assert.match(stdout, /attempt 2: refused: kept CardDeclined/);
});
