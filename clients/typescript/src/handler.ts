/**
 * A wrapper that gives an Express or Fastify handler `Idempotency-Key` semantics over
 * `idem serve`: the first request with a key runs the handler and its answer is kept; every
 * retry with the key is given that answer, marked `Idempotent-Replayed: true`.
 */

import { createHash } from "node:crypto";

import { IdemError, NOT_KEPT, PreviousFailure } from "./errors.js";
import type { Idem } from "./client.js";

/** The parts of an Express `Request` or a Fastify `FastifyRequest` the wrapper reads. */
export interface RequestLike {
  method: string;
  url: string;
  /** Express's URL before a router's mount path was taken off (fingerprinted when present). */
  originalUrl?: string;
  headers: Record<string, string | string[] | undefined>;
  body?: unknown;
}

/** The parts of an Express `Response` or a Fastify `FastifyReply` the wrapper writes. */
export interface ReplyLike {
  status(code: number): ReplyLike;
  header(name: string, value: string): ReplyLike;
  send(body: unknown): unknown;
}

/** What a wrapped handler answers: a status (200 by default) and a JSON body (kept and
 * replayed as JSON). */
export interface HandlerResult {
  status?: number;
  body: unknown;
}

export interface HandlerOptions<Req extends RequestLike> {
  /** The namespace of the route's keys. */
  namespace: string;
  /** The request's key (the `Idempotency-Key` header by default). */
  key?: (req: Req) => string | undefined;
  /** Whose the key is (the authenticated user, say): callers with different scopes never
   * share a key. Without it every caller of the route shares one set of keys. */
  scope?: (req: Req) => string | undefined;
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
    const given = options.key ? options.key(req) : header(req, "idempotency-key");
    if (given === undefined) {
      if (options.required) {
        problem(reply, 400, "idempotency_key_missing", "This route requires an Idempotency-Key header.");
        return;
      }
      const result = await fn(req);
      reply.status(result.status ?? 200).send(result.body);
      return;
    }
    if (!options.request && req.body === undefined && hasBody(req)) {
      // Fingerprinted as no body, a retry with another body would be given the first answer.
      throw new Error("idempotent(): the request has a body that no body parser read; add one (express.json()) or give `request`");
    }
    const scope = options.scope?.(req);
    const key = scope === undefined ? given : `${createHash("sha256").update(scope).digest("hex").slice(0, 16)}:${given}`;
    let fresh: { status: number; body: unknown } | undefined;
    try {
      const result = await idem.once(
        key,
        async () => {
          const result = await fn(req);
          fresh = { status: result.status ?? 200, body: result.body };
          if (fresh.status >= 500) throw new ServerError(fresh);
          return fresh;
        },
        {
          namespace: options.namespace,
          request: options.request
            ? options.request(req)
            : { method: req.method, url: req.originalUrl ?? req.url, body: req.body ?? null },
          lease: options.lease,
          wait: options.wait ?? 0,
        },
      );
      if (fresh === undefined) reply.header("idempotent-replayed", "true");
      reply.status(result.status).send(result.body);
    } catch (e) {
      if (e instanceof ServerError) {
        reply.status(e.result.status).send(e.result.body);
      } else if (e instanceof PreviousFailure && e.errorName === NOT_KEPT) {
        if (fresh !== undefined) {
          // It ran here, and its answer could not be kept (too large, not JSON): this caller
          // gets it; a retry gets the refusal below, and the handler never runs again.
          reply.status(fresh.status).send(fresh.body);
        } else {
          problem(reply, 409, "response_not_replayable", "The request with the key was processed but its response was too large to store; it is not run again.");
        }
      } else if (e instanceof IdemError && FORWARDED.has(e.code)) {
        // The caller's to mend or wait out: in_progress (409, with Retry-After),
        // fingerprint_mismatch (422), a key idem refuses (400).
        if (e.retryAfter !== undefined) reply.header("retry-after", String(Math.max(1, Math.ceil(e.retryAfter))));
        problem(reply, e.status, e.code, e.detail);
      } else if (e instanceof IdemError && UNAVAILABLE.has(e.code)) {
        reply.header("retry-after", String(Math.max(1, Math.ceil(e.retryAfter ?? 1))));
        problem(reply, 503, e.code, "The idempotency store is unavailable; nothing was done. Retry later.");
      } else {
        throw e; // idem's refusal of this service (its API key, its options): a server error
      }
    }
  };
}

/** idem's refusals that are the end caller's to act on, given to them as they are. */
const FORWARDED = new Set(["in_progress", "fingerprint_mismatch", "invalid_key", "body_too_large"]);
/** idem or its store down: nothing ran, the caller may retry. */
const UNAVAILABLE = new Set(["store_unavailable", "overloaded", "unreachable"]);

function hasBody(req: RequestLike): boolean {
  const length = header(req, "content-length");
  return (length !== undefined && length !== "0") || header(req, "transfer-encoding") !== undefined;
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
