// An order charged once, however often it is retried: run `idem serve`
// (cargo run --release --bin idem -- serve), then, in clients/typescript,
//
//     npm run build && node dist/examples/orders.js [IDEM_URL] [API_KEY]

import { randomUUID } from "node:crypto";
import { Idem, PreviousFailure } from "../src/index.js";

const [url = "http://127.0.0.1:7070", apiKey] = process.argv.slice(2);
const idem = new Idem(url, apiKey ? { apiKey } : {});
const namespace = `example-${randomUUID().slice(0, 8)}`; // a fresh run each time
let charged = 0;

class CardDeclined extends Error {
  override name = "CardDeclined";
}

const order = { id: "o-1", amount: 100 };
const charge = async (o: { id: string; amount: number }) => {
  if (o.amount > 1000) throw new CardDeclined(`cannot charge ${o.amount}`);
  charged++;
  return { charge: `ch-${o.id}`, amount: o.amount };
};
const options = { namespace, request: order, permanent: (e: unknown) => e instanceof CardDeclined };

for (const attempt of [1, 2, 3]) {
  console.log(`attempt ${attempt}:`, await idem.once(order.id, () => charge(order), options));
}
console.log(`charged ${charged} time(s)`);

const big = { id: "o-2", amount: 5000 };
for (const attempt of [1, 2]) {
  try {
    await idem.once(big.id, () => charge(big), { ...options, request: big });
  } catch (e) {
    console.log(`attempt ${attempt}: refused:`, e instanceof PreviousFailure ? `kept ${e.errorName}` : String(e));
  }
}
