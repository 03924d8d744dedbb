/**
 * A client of `idem serve`: run work once per key, in steps that resume after a crash, with
 * ids, one-time tokens and fenced locks. On `fetch`; its types are generated from the served
 * OpenAPI document (`npm run generate`), so they follow the API.
 *
 * ```ts
 * const idem = new Idem("http://127.0.0.1:7070", { apiKey });
 * const charge = await idem.once(order.id, () => bank.charge(order), { namespace: "orders", request: order });
 * ```
 */

export {
  Idem,
  type BeginAnswer,
  type IdemOptions,
  type Lease,
  type RecordedStep,
  type RecordView,
  type Run,
  type RunOptions,
} from "./client.js";
export { IdemError, LeaseLost, NOT_KEPT, PreviousFailure, PROBLEM_CODES, type ProblemCode } from "./errors.js";
export { idempotent, type HandlerOptions, type HandlerResult, type ReplyLike, type RequestLike } from "./handler.js";
