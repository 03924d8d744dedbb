/**
 * The client of `idem serve`: the record API call by call, work run once per key (`once`,
 * `run` with its steps), ids, one-time tokens and fenced locks.
 */

import type { components } from "./generated/schema.js";
import { IdemError, LeaseLost, NOT_KEPT, PreviousFailure, RETRYABLE } from "./errors.js";
import { asJson, toJson } from "./json.js";

type Schemas = components["schemas"];
/** The attempt's hold on a key: its token (`id`), fence, and end. */
export type Lease = Schemas["LeaseView"];
/** A step an earlier attempt recorded. */
export type RecordedStep = Schemas["StepView"];
/** What `begin` answers: `acquired` (with a lease) or `replay` (with the stored response). */
export type BeginAnswer = Schemas["BeginAnswer"];
/** A caller's record. */
export type RecordView = Schemas["RecordView"];

/** How a client reaches `idem serve`. */
export interface IdemOptions {
  /** The caller's API key (keys are scoped to the caller). */
  apiKey?: string;
  /** Tries in all of each of idem's own calls when the server or store is unavailable (5). */
  attempts?: number;
  /** How long each call may take, in milliseconds (10 000). */
  timeoutMs?: number;
  /** The `fetch` to use (the global one by default). */
  fetch?: typeof fetch;
}

/** How a call under a key is run. */
export interface RunOptions {
  /** The namespace of the key (`"once"` by default). */
  namespace?: string;
  /** What the call is fingerprinted by (any JSON; `null` by default): the same key with another
   * request is refused with `fingerprint_mismatch`, never run. */
  request?: unknown;
  /** The lease, in seconds (60): renewed in the background while the work runs. */
  lease?: number;
  /** How long the record is kept, in seconds (the server's default). */
  ttl?: number;
  /** How long to wait for an attempt in flight, in seconds (30), before `in_progress`. */
  wait?: number;
  /** Whether a failure is kept (every retry then throws {@link PreviousFailure}) rather than
   * releasing the key for a retry to run again. Nothing is permanent by default. */
  permanent?: (error: unknown) => boolean;
  /** Steps whose step keys to ask for (see {@link Run.stepKeys}). */
  stepKeys?: string[];
  /** Stops this caller's wait: once it aborts, the call rejects with its reason. Work already
   * begun runs on to its end and its result is kept for the next call; work that stops on an
   * abort is a cancellation, not a failure (see {@link Idem.run}). */
  signal?: AbortSignal;
}

/** One attempt at the work under a key, handed to the work of {@link Idem.run}. */
export interface Run {
  readonly namespace: string;
  readonly key: string;
  readonly lease: Lease;
  /** The steps earlier attempts recorded, by name. */
  readonly steps: ReadonlyMap<string, RecordedStep>;
  /** The step keys asked for with `stepKeys`: the keys to send to the services the steps call,
   * the same on every attempt. */
  readonly stepKeys: Readonly<Record<string, string>>;
  /** Whether another attempt took the key over while this one ran (seen by the renewal). */
  readonly lost: boolean;
  /** Runs step `name` and records its output (JSON), or returns the output an earlier attempt
   * recorded without running it: either way as JSON gives it back. */
  step<T>(name: string, fn: () => Promise<T> | T): Promise<T>;
}

const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms));
const ms = (seconds: number) => Math.max(1, Math.round(seconds * 1000));

/** A client of `idem serve` at `url`. */
export class Idem {
  readonly #url: string;
  readonly #headers: Record<string, string>;
  readonly #attempts: number;
  readonly #timeoutMs: number;
  readonly #fetch: typeof fetch;

  constructor(url = "http://127.0.0.1:7070", options: IdemOptions = {}) {
    this.#url = url.replace(/\/+$/, "");
    this.#headers = { "content-type": "application/json" };
    if (options.apiKey) this.#headers.authorization = `Bearer ${options.apiKey}`;
    this.#attempts = Math.max(1, options.attempts ?? 5);
    this.#timeoutMs = options.timeoutMs ?? 10_000;
    this.#fetch = options.fetch ?? globalThis.fetch;
  }

  /** One call of idem's API, tried again (with backoff and the server's `Retry-After`) while
   * the server or its store is unavailable, or (if `repeatable`: safe to send twice) cannot be
   * reached. */
  async #call<T>(
    method: "GET" | "POST",
    path: string,
    body?: unknown,
    {
      attempts = this.#attempts,
      repeatable = true,
      timeoutMs = this.#timeoutMs,
    }: { attempts?: number; repeatable?: boolean; timeoutMs?: number } = {},
  ): Promise<T> {
    // A value JSON cannot hold as it is (see toJson) throws here, to the caller, never retried.
    const text = body === undefined ? undefined : toJson(body);
    for (let attempt = 0; ; attempt++) {
      let error: IdemError;
      try {
        const res = await this.#fetch(this.#url + path, {
          method,
          headers: this.#headers,
          body: text,
          signal: AbortSignal.timeout(timeoutMs),
        });
        if (res.ok) return (await res.json()) as T;
        error = await problem(res);
      } catch (e) {
        if (e instanceof IdemError) throw e;
        error = new IdemError("unreachable", `idem serve did not answer: ${String(e)}`);
      }
      // A call not safe to send twice is not repeated when the server did not answer.
      const retryable = RETRYABLE.has(error.code) && (repeatable || error.code !== "unreachable");
      if (!retryable || attempt + 1 >= attempts) throw error;
      await sleep(backoff(attempt, error.retryAfter));
    }
  }

  // The record API, call by call.

  /** Claims `key`. Throws `in_progress` while another attempt holds it. */
  begin(
    namespace: string,
    key: string,
    options: { request?: unknown; lease?: number; ttl?: number; stepKeys?: string[] } = {},
  ): Promise<BeginAnswer> {
    const body: Schemas["BeginBody"] = { namespace, key, request: options.request ?? null };
    if (options.lease !== undefined) body.lease_ms = ms(options.lease);
    if (options.ttl !== undefined) body.ttl_ms = ms(options.ttl);
    if (options.stepKeys?.length) body.step_keys = options.stepKeys;
    return this.#call("POST", "/v1/records/begin", body);
  }

  /** Records step `name` under the lease: done with `output`, or `unknown`. */
  async step(namespace: string, key: string, lease: Lease | string, name: string, output: unknown, unknown = false): Promise<void> {
    const body: Schemas["StepBody"] = unknown
      ? { namespace, key, lease: token(lease), step: name, unknown: true }
      : { namespace, key, lease: token(lease), step: name, output: output ?? null };
    await this.#call("POST", "/v1/records/step", body);
  }

  /** Extends the lease to `length` seconds from now. Throws `stale_lease` once overtaken. */
  async renew(namespace: string, key: string, lease: Lease | string, length?: number): Promise<Lease> {
    const body: Schemas["RecordRenewBody"] = { namespace, key, lease: token(lease) };
    if (length !== undefined) body.lease_ms = ms(length);
    return (await this.#call<Schemas["Renewed"]>("POST", "/v1/records/renew", body)).lease;
  }

  /** Stores `response` (any JSON) under the lease. */
  async complete(namespace: string, key: string, lease: Lease | string, response: unknown): Promise<void> {
    const body: Schemas["CompleteBody"] = { namespace, key, lease: token(lease), response };
    await this.#call("POST", "/v1/records/complete", body);
  }

  /** Gives the key back after a failure that is safe to retry. */
  async release(namespace: string, key: string, lease: Lease | string): Promise<void> {
    const body: Schemas["RecordReleaseBody"] = { namespace, key, lease: token(lease) };
    await this.#call("POST", "/v1/records/release", body);
  }

  /** The caller's record under `key`, or `undefined`. */
  async record(namespace: string, key: string): Promise<RecordView | undefined> {
    try {
      return await this.#call("GET", `/v1/records/${segment(namespace)}/${segment(key)}`);
    } catch (e) {
      if (IdemError.is(e, "not_found")) return undefined;
      throw e;
    }
  }

  // Running work once per key.

  /**
   * Runs `fn` once per `key`: every later call with the key is given the first call's result
   * (or, for a failure `permanent` judges so, throws {@link PreviousFailure}). A call whose key
   * another attempt holds waits for it. Without `request` the key alone identifies the call.
   * The result must be JSON: this call and every later one are given it as JSON gives it back
   * (`undefined` as `null`, a `Date` as its string), whatever `T` says.
   */
  once<T>(key: string, fn: () => Promise<T> | T, options: RunOptions = {}): Promise<T> {
    return this.run(key, options, () => fn());
  }

  /**
   * Runs `work` once per `key`, handing it the {@link Run}: its steps, recorded as they finish,
   * are skipped with their outputs by the attempt that takes over after a crash.
   *
   * A cancellation is not a failure of the work: work that ends in an abort (an `AbortError` or
   * `TimeoutError`, or any error once `signal` has aborted) may have had its effect, so its key
   * is neither released nor given a failure. It is kept, renewed no more, until its lease ends;
   * till then every call is refused with `in_progress`.
   */
  async run<T>(key: string, options: RunOptions, work: (run: Run) => Promise<T> | T): Promise<T> {
    const { signal } = options;
    signal?.throwIfAborted();
    const namespace = options.namespace ?? "once";
    const length = options.lease ?? 60;
    const begun = await this.#beginWaiting(namespace, key, options, length);
    if (begun.outcome === "replay") return resultOf(begun.response) as T;
    if (signal?.aborted) {
      // Nothing ran: the key is free for the next call.
      await this.release(namespace, key, begun.lease).catch(() => undefined);
      throw signal.reason;
    }
    const attempt = this.#attempt(namespace, key, begun, options, length, work);
    return signal ? untilAborted(attempt, signal) : attempt;
  }

  /** Runs the work under the lease `begun` holds, and keeps its result. */
  async #attempt<T>(
    namespace: string,
    key: string,
    begun: Extract<BeginAnswer, { outcome: "acquired" }>,
    options: RunOptions,
    length: number,
    work: (run: Run) => Promise<T> | T,
  ): Promise<T> {
    // One try per beat: the next beat tries again, and the run's end never waits on it.
    const renewOnce = (body: Schemas["RecordRenewBody"]) => this.#call("POST", "/v1/records/renew", body, { attempts: 1 });
    const run = new ActiveRun(this, renewOnce, namespace, key, begun.lease, begun.steps, begun.step_keys ?? {});
    const keeper = setInterval(() => void run.keepAlive(length), ms(length / 3));
    try {
      let value: T;
      try {
        value = await work(run);
      } catch (e) {
        clearInterval(keeper);
        if (e instanceof StepNotKept) {
          await run.settle({ error: { type: NOT_KEPT, message: e.message } });
          throw new PreviousFailure(NOT_KEPT, e.message);
        }
        // The key is kept, and its lease, renewed no more, ends: a release would let a retry
        // run again work that may have had its effect.
        if (cancelled(e, options.signal)) throw e;
        if (options.permanent?.(e)) {
          await run.settle({ error: { type: errorName(e), message: errorMessage(e) } });
        } else {
          await this.release(namespace, key, run.lease).catch(() => undefined);
        }
        throw e;
      }
      clearInterval(keeper);
      let kept: unknown;
      try {
        kept = asJson(value);
        await run.settle({ value: kept });
      } catch (e) {
        if (!(e instanceof TypeError) && !(e instanceof IdemError && e.status >= 400 && e.status < 500)) throw e;
        // It ran, so it must not run again: its failure to be kept is kept.
        await run.settle({ error: { type: NOT_KEPT, message: `the result could not be stored: ${errorMessage(e)}` } });
        throw new PreviousFailure(NOT_KEPT, errorMessage(e));
      }
      return kept as T;
    } finally {
      clearInterval(keeper);
    }
  }

  async #beginWaiting(namespace: string, key: string, options: RunOptions, length: number) {
    const deadline = Date.now() + (options.wait ?? 30) * 1000;
    for (let attempt = 0; ; attempt++) {
      try {
        return await this.begin(namespace, key, {
          request: options.request,
          lease: length,
          ttl: options.ttl,
          stepKeys: options.stepKeys,
        });
      } catch (e) {
        const left = deadline - Date.now();
        if (!IdemError.is(e, "in_progress") || left <= 0) throw e;
        // The attempt in flight may finish any moment; its Retry-After is its lease's end.
        const poll = Math.min(50 * 2 ** Math.min(attempt, 5), 1000);
        const pause = sleep(Math.min(poll, (e.retryAfter ?? Infinity) * 1000, left));
        await (options.signal ? untilAborted(pause, options.signal) : pause);
      }
    }
  }

  // Ids, one-time tokens and locks.

  /** `count` UUIDv7 ids. */
  async uuid7(count = 1): Promise<string[]> {
    return (await this.#call<Schemas["Uuid7Ids"]>("GET", `/v1/ids/uuid7?count=${count}`)).ids;
  }

  /** `count` Snowflake ids, as strings (they pass 2^53). */
  async snowflake(count = 1): Promise<string[]> {
    const answer = await this.#call<Schemas["SnowflakeIds"]>("GET", `/v1/ids/snowflake?count=${count}`);
    return answer.id_strings;
  }

  /** The next `count` numbers of the caller's sequence `tag`, as strings. */
  async segment(tag: string, count = 1): Promise<string[]> {
    const answer = await this.#call<Schemas["SegmentIds"]>("GET", `/v1/ids/segment/${segment(tag)}?count=${count}`);
    return answer.id_strings;
  }

  /** A one-time token for `purpose`. */
  async issueToken(purpose: string, ttl?: number): Promise<string> {
    const body: Schemas["IssueBody"] = { purpose };
    if (ttl !== undefined) body.ttl_ms = ms(ttl);
    return (await this.#call<Schemas["IssuedToken"]>("POST", "/v1/tokens", body)).token;
  }

  /** Uses the token up; throws `already_used`, `expired`, `wrong_purpose` or `unknown`. */
  async consumeToken(tokenValue: string, purpose: string): Promise<void> {
    const body: Schemas["ConsumeBody"] = { token: tokenValue, purpose };
    // Not repeated after a lost answer: a consumed token would then read as used.
    await this.#call("POST", "/v1/tokens/consume", body, { repeatable: false });
  }

  /** Runs `work` holding the lock `name`, with the fence to send with every write it protects;
   * throws `lock_held` if another holds it (after `wait` seconds). */
  async withLock<T>(name: string, options: { lease?: number; wait?: number }, work: (lock: Schemas["Holding"]) => Promise<T> | T): Promise<T> {
    const path = `/v1/locks/${segment(name)}`;
    const wait = Math.max(0, Math.round((options.wait ?? 0) * 1000));
    const acquire: Schemas["AcquireBody"] = { lease_ms: ms(options.lease ?? 30), wait_ms: wait };
    // Not repeated after a lost answer: the lock would be held by a handle nobody has. It may
    // wait at the server, so its time is the call's plus the wait.
    const held = await this.#call<Schemas["Holding"]>("POST", `${path}/acquire`, acquire, {
      repeatable: false,
      timeoutMs: this.#timeoutMs + wait,
    });
    try {
      return await work(held);
    } finally {
      const release: Schemas["LockReleaseBody"] = { lock: held.lock };
      await this.#call("POST", `${path}/release`, release).catch(() => undefined);
    }
  }
}

class ActiveRun implements Run {
  readonly steps: Map<string, RecordedStep>;
  lost = false;
  #settled = false;
  #renewing = false;

  constructor(
    readonly idem: Idem,
    private readonly renewOnce: (body: Schemas["RecordRenewBody"]) => Promise<unknown>,
    readonly namespace: string,
    readonly key: string,
    readonly lease: Lease,
    steps: RecordedStep[],
    readonly stepKeys: Record<string, string>,
  ) {
    this.steps = new Map(steps.map((s) => [s.step, s]));
  }

  async step<T>(name: string, fn: () => Promise<T> | T): Promise<T> {
    const recorded = this.steps.get(name);
    if (recorded?.outcome === "done") return recorded.output as T;
    const output = await fn();
    let kept: unknown;
    try {
      kept = asJson(output);
      await this.idem.step(this.namespace, this.key, this.lease, name, kept);
    } catch (e) {
      // It ran and its output cannot be recorded (not JSON, too large): the run ends with
      // its failure kept, so that no retry runs the step again.
      if (e instanceof TypeError || (e instanceof IdemError && (e.status === 400 || e.status === 413))) {
        throw new StepNotKept(name, e);
      }
      throw e;
    }
    this.steps.set(name, { step: name, step_key: recorded?.step_key ?? "", outcome: "done", output: kept });
    return kept as T;
  }

  async keepAlive(length: number): Promise<void> {
    // At most one renewal in flight: a beat that finds one still waiting leaves it be.
    if (this.#settled || this.lost || this.#renewing) return;
    this.#renewing = true;
    try {
      await this.renewOnce({ namespace: this.namespace, key: this.key, lease: this.lease.id, lease_ms: ms(length) });
    } catch (e) {
      if (IdemError.is(e, "stale_lease")) this.lost = true;
      // Anything else: tried again at the next beat; the lease runs until then.
    } finally {
      this.#renewing = false;
    }
  }

  async settle(response: unknown): Promise<void> {
    this.#settled = true;
    try {
      await this.idem.complete(this.namespace, this.key, this.lease, response);
    } catch (e) {
      if (IdemError.is(e, "stale_lease")) throw new LeaseLost(`the lease on ${this.key} was taken over`);
      throw e;
    }
  }
}

/** `work`'s end, or `signal`'s reason as soon as it aborts: the caller stops waiting, and the
 * work runs on to its end, which nobody then awaits. */
function untilAborted<T>(work: Promise<T>, signal: AbortSignal): Promise<T> {
  work.catch(() => undefined);
  return new Promise<T>((resolve, reject) => {
    const stop = () => reject(signal.reason);
    if (signal.aborted) return stop();
    signal.addEventListener("abort", stop, { once: true });
    work.then(resolve, reject).finally(() => signal.removeEventListener("abort", stop));
  });
}

/** Whether the work was cancelled rather than failed: `signal` has aborted, or `e`, or an
 * error it was caused by, is an abort as `fetch`, timers and streams throw one. */
function cancelled(e: unknown, signal: AbortSignal | undefined): boolean {
  if (signal?.aborted) return true;
  let cause = e;
  for (let depth = 0; cause instanceof Object && depth < 8; depth++) {
    const { name } = cause as { name?: unknown };
    if (name === "AbortError" || name === "TimeoutError") return true;
    cause = (cause as { cause?: unknown }).cause;
  }
  return false;
}

/** A step that ran and whose output could not be recorded. */
class StepNotKept extends Error {
  constructor(step: string, cause: unknown) {
    super(`the output of step ${step} could not be stored: ${errorMessage(cause)}`);
  }
}

/** A kept result as the call returns it: `{"value"}` its value, `{"error"}` thrown as
 * {@link PreviousFailure}; a response another program stored, as it is. */
function resultOf(response: unknown): unknown {
  if (response && typeof response === "object" && !Array.isArray(response)) {
    const keys = Object.keys(response);
    const kept = response as { value?: unknown; error?: { type?: unknown; message?: unknown } };
    if (keys.length === 1 && keys[0] === "value") return kept.value;
    if (keys.length === 1 && keys[0] === "error" && kept.error && typeof kept.error === "object") {
      throw new PreviousFailure(String(kept.error.type ?? ""), String(kept.error.message ?? ""));
    }
  }
  return response;
}

async function problem(res: Response): Promise<IdemError> {
  let body: Record<string, unknown> = {};
  try {
    const parsed: unknown = await res.json();
    if (parsed && typeof parsed === "object") body = parsed as Record<string, unknown>;
  } catch {
    // not JSON: described below
  }
  const code = typeof body.code === "string" ? body.code : "unexpected_answer";
  const detail = typeof body.detail === "string" ? body.detail : `idem answered ${res.status}`;
  let retryAfter: number | undefined;
  if (typeof body.retry_after_ms === "number") retryAfter = body.retry_after_ms / 1000;
  else if (res.headers.get("retry-after")) retryAfter = Number(res.headers.get("retry-after")) || undefined;
  return new IdemError(code, detail, res.status, retryAfter, body);
}

/** Backoff before attempt `attempt + 1`: the server's advice (capped at 2 s), else 50 ms
 * doubling to 2 s, with jitter. */
function backoff(attempt: number, advice: number | undefined): number {
  if (advice !== undefined) return Math.min(Math.max(advice, 0), 2) * 1000;
  const base = Math.min(50 * 2 ** Math.min(attempt, 6), 2000);
  return base * (0.5 + Math.random() / 2);
}

function token(lease: Lease | string): string {
  return typeof lease === "string" ? lease : lease.id;
}

function segment(text: string): string {
  return encodeURIComponent(text);
}

function errorName(e: unknown): string {
  return e instanceof Error ? e.name : typeof e;
}

function errorMessage(e: unknown): string {
  return e instanceof Error ? e.message : String(e);
}
