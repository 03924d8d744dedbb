/**
 * A wrapper that gives an Express or Fastify handler `Idempotency-Key` semantics over
 * `idem serve`: the first request with a key runs the handler and its answer is kept; every
 * retry with the key from the same caller is given that answer, marked
 * `Idempotent-Replayed: true`.
 */

import type { Idem } from "./client.js";
import { IdemError, NOT_KEPT, PreviousFailure } from "./errors.js";
import { KeyHeaderError, keyOf } from "./key.js";
import { credential, MAX_NAMESPACE_LENGTH, scopedNamespace } from "./scope.js";

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
  /** The namespace of the route's keys: 1 to 95 ASCII letters, digits, `.`, `_`, `:` or `-`
   * (idem's limit less the caller's scope, which the wrapper adds to it). */
  namespace: string;
  /** The request's key (the `Idempotency-Key` header by default, quoted or bare). */
  key?: (req: Req) => string | undefined;
  /** Who the caller is (the authenticated user, say; `undefined` or blank for no one): two
   * callers' keys never meet. By default, the request's `Authorization` header. Only a hash
   * of it is kept. */
  scope?: (req: Req) => string | undefined;
  /** What a guarded request whose caller is no one gets: `"refuse"` (401
   * `credential_required`, the default), or `"shared"`: all such requests share one set of
   * keys, so each can be given another's stored answer by sending its key. Only for routes
   * whose anonymous callers are one party. */
  anonymous?: "refuse" | "shared";
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
 * async (req) => ({ status: 201, body: await createOrder(req.body) })))`. Keys are each
 * caller's own (see {@link HandlerOptions.scope}). A 5xx answer, or an exception, releases the
 * key so a retry runs again; any other answer is kept. An exception that is an abort (see
 * {@link Idem.run}) keeps the key until its lease ends.
 */
export function idempotent<Req extends RequestLike, Reply extends ReplyLike>(
  idem: Idem,
  options: HandlerOptions<Req>,
  fn: (req: Req) => Promise<HandlerResult> | HandlerResult,
): (req: Req, reply: Reply) => Promise<void> {
  if (!NAMESPACE.test(options.namespace)) {
    throw new TypeError(
      `idempotent(): the namespace must be 1 to ${MAX_NAMESPACE_LENGTH} ASCII letters, digits, ".", "_", ":" or "-"`,
    );
  }
  return async (req, reply) => {
    let given: string | KeyHeaderError | undefined;
    try {
      given = options.key ? options.key(req) : keyOf(req.headers["idempotency-key"]);
    } catch (e) {
      if (!(e instanceof KeyHeaderError)) throw e;
      given = e;
    }
    if (given === undefined && !options.required) {
      const result = await fn(req);
      reply.status(result.status ?? 200).send(result.body);
      return;
    }
    const who = callerOf(req, options);
    if (who === undefined && options.anonymous !== "shared") {
      const detail = options.scope
        ? "This route keeps each caller's stored answers apart by who the caller is, and the request does not say; send an Idempotency-Key with a credential."
        : "This route keeps each caller's stored answers apart by the authorization header; send it with an Idempotency-Key.";
      problem(reply, 401, "credential_required", detail);
      return;
    }
    if (given instanceof KeyHeaderError) {
      problem(reply, 400, "idempotency_key_invalid", given.message);
      return;
    }
    if (given === undefined) {
      problem(reply, 400, "idempotency_key_missing", "This route requires an Idempotency-Key header.");
      return;
    }
    if (!options.request && req.body === undefined && hasBody(req)) {
      // Fingerprinted as no body, a retry with another body would be given the first answer.
      const detail =
        "The route reads no body of this Content-Type, so it cannot tell the request from another with the same Idempotency-Key; send the body as the route expects (application/json).";
      problem(reply, 415, "unsupported_media_type", detail);
      return;
    }
    const namespace = scopedNamespace(options.namespace, options.scope ? "app" : "credential", who);
    const key = given;
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
          namespace,
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

/** Who the caller is, by the app's `scope` or else the request's credential; `undefined` for
 * no one. */
function callerOf<Req extends RequestLike>(req: Req, options: HandlerOptions<Req>): string | undefined {
  if (!options.scope) return credential(req.headers);
  const who = options.scope(req);
  return who?.trim() ? who : undefined;
}

const NAMESPACE = new RegExp(`^[A-Za-z0-9._:-]{1,${MAX_NAMESPACE_LENGTH}}$`);

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
