// A worker that records its first step and is then killed by the test: node child.js URL KEY NS EFFECTS

import { appendFileSync } from "node:fs";
import { Idem } from "../src/index.js";

const [url, apiKey, namespace, effects] = process.argv.slice(2) as [string, string, string, string];
const idem = new Idem(url, { apiKey });
await idem.run("transfer-1", { namespace, request: { amount: 100 }, lease: 1 }, async (run) => {
  await run.step("debit", () => {
    appendFileSync(effects, "debit\n");
    return { done: "debit" };
  });
  console.log("debited");
  await new Promise((r) => setTimeout(r, 60_000));
  return "never";
});
