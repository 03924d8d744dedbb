// A worker that runs a transfer's steps and is killed by the test after one of them:
// node child.js URL KEY NS EFFECTS. It prints each step's name once that step is recorded
// (a step an earlier attempt recorded is skipped, unrun and unprinted).

import { appendFileSync } from "node:fs";
import { Idem } from "../src/index.js";

const [url, apiKey, namespace, effects] = process.argv.slice(2) as [string, string, string, string];
const idem = new Idem(url, { apiKey });
await idem.run("transfer-1", { namespace, request: { amount: 100 }, lease: 1, wait: 10 }, async (run) => {
  for (const name of ["debit", "fee", "credit"]) {
    if (run.steps.get(name)?.outcome === "done") continue;
    await run.step(name, () => {
      appendFileSync(effects, `${name}\n`);
      return { done: name };
    });
    console.log(name);
    await new Promise((r) => setTimeout(r, 60_000));
  }
  return "never";
});
