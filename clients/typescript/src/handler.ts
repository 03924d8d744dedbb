/**
 * A wrapper that gives an Express or Fastify handler `Idempotency-Key` semantics over
 * `idem serve`: the first request with a key runs the handler and its answer is kept; every
 * retry with the key is given that answer, marked `Idempotent-Replayed: true`.
 */

import { IdemError } from "./errors.js";
import type { Idem } from "./index.js";

/** The parts of an Express `Request` or a Fastify `FastifyRequest` the wrapper reads. */
export interface RequestLike {
  method: string;
  url: string;
  headers: Record<string, string | string[] | undefined>;
  body?: unknown;
}

/** The parts of an Express `Response` or a Fastify `FastifyReply` the wrapper writes. */
export interface ReplyLike {
  status(code: number): ReplyLike;
  header(name: string, value: string): ReplyLike;
  send(body: unknown): unknown;
}

/** What a wrapped handler answers: a status (200 by default) and a JSON body. */
export interface HandlerResult {
  status?: number;
  body: unknown;
}

export interface HandlerOptions<Req extends RequestLike> {
  /** The namespace of the route's keys. */
  namespace: string;
  /** The request's key (the `Idempotency-Key` header by default). */
  key?: (req: Req) => string | undefined;
  /** Whether a request without a key is refused (400) rather than run unguarded. */
  required?: boolean;
  /** What the request is fingerprinted by (method, URL and body by default). */
  request?: (req: Req) => unknown;
  /** The lease in seconds (60), renewed while the handler runs. */
  lease?: number;
  /** How long a retry waits for the request in flight, in seconds (0: answer 409 at once). */
  wait?: number;
}

/**
 * `fn` behind `Idempotency-Key`: `app.post("/orders", idempotent(idem, { namespace: "orders" },
 * async (req) => ({ status: 201, body: await createOrder(req.body) })))`. A 5xx answer, or an
 * exception, releases the key so a retry runs again; any other answer is kept.
 */
export function idempotent<Req extends RequestLike, Reply extends ReplyLike>(
  idem: Idem,
  options: HandlerOptions<Req>,
  fn: (req: Req) => Promise<HandlerResult> | HandlerResult,
): (req: Req, reply: Reply) => Promise<void> {
  return async (req, reply) => {
    const key = options.key ? options.key(req) : header(req, "idempotency-key");
    if (key === undefined) {
      if (options.required) {
        problem(reply, 400, "idempotency_key_missing", "This route requires an Idempotency-Key header.");
        return;
      }
      const result = await fn(req);
      reply.status(result.status ?? 200).send(result.body);
      return;
    }
    let replayed = true;
    try {
      const result = await idem.once(
        key,
        async () => {
          replayed = false;
          const result = await fn(req);
          const kept = { status: result.status ?? 200, body: result.body };
          if (kept.status >= 500) throw new ServerError(kept);
          return kept;
        },
        {
          namespace: options.namespace,
          request: options.request ? options.request(req) : { method: req.method, url: req.url, body: req.body ?? null },
          lease: options.lease,
          wait: options.wait ?? 0,
        },
      );
      if (replayed) reply.header("idempotent-replayed", "true");
      reply.status(result.status).send(result.body);
    } catch (e) {
      if (e instanceof ServerError) {
        reply.status(e.result.status).send(e.result.body);
      } else if (e instanceof IdemError && e.status >= 400 && e.status < 500) {
        // in_progress (409, with Retry-After), fingerprint_mismatch (422), bad keys (400).
        if (e.retryAfter !== undefined) reply.header("retry-after", String(Math.max(1, Math.ceil(e.retryAfter))));
        problem(reply, e.status, e.code, e.detail);
      } else {
        throw e;
      }
    }
  };
}

/** A 5xx answer: given to the caller, not kept. */
class ServerError extends Error {
  constructor(readonly result: { status: number; body: unknown }) {
    super(`the handler answered ${result.status}`);
  }
}

function header(req: RequestLike, name: string): string | undefined {
  const value = req.headers[name];
  return Array.isArray(value) ? value[0] : value;
}

function problem(reply: ReplyLike, status: number, code: string, detail: string): void {
  reply
    .status(status)
    .header("content-type", "application/problem+json")
    .send(JSON.stringify({ type: `urn:idem:problem:${code}`, status, code, detail }));
}
