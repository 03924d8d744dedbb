/**
 * Every problem `idem serve` answers with: an {@link IdemError} whose `code` is one of the
 * catalogue's {@link PROBLEM_CODES} (a test keeps the list equal to the catalogue), so that a
 * caller branches on `e.code` with the compiler checking the spelling.
 */

/** Every problem code of the catalogue, as `idem serve` answers it. */
export const PROBLEM_CODES = [
  "invalid_request", "not_found", "method_not_allowed", "unauthorized",
  "unsupported_media_type", "malformed_json", "body_too_large", "body_timeout", "invalid_path",
  "internal_error", "overloaded", "store_unavailable", "store_error", "store_full",
  "invalid_key", "invalid_duration", "invalid_lease", "invalid_fingerprint", "in_progress",
  "fingerprint_mismatch", "stale_lease", "invalid_step", "step_conflict", "step_after_unknown",
  "steps_full", "idempotency_key_missing", "idempotency_key_invalid",
  "idempotency_key_mismatch", "request_in_progress", "outcome_unknown",
  "response_not_replayable", "answer_not_stored", "response_failed", "handler_failed",
  "record_corrupt", "request_body_unreadable", "ambiguous_path", "ambiguous_method",
  "credential_required", "upstream_unreachable", "upstream_failed", "upstream_timeout",
  "admin_disabled", "record_not_found", "record_tools_unsupported", "not_unknown",
  "force_required", "internal_record", "token_missing", "already_used", "expired",
  "wrong_purpose", "unknown", "locks_unsupported", "invalid_lock_name", "invalid_lock",
  "invalid_owner", "invalid_wait", "lock_held", "not_owner", "lock_error", "invalid_count",
  "invalid_tag", "tag_quota_exceeded", "too_many_tags", "no_worker_id", "worker_lease_expired",
  "worker_lost", "ids_unavailable", "ids_busy",
] as const;

/** A problem code of the catalogue. */
export type ProblemCode = (typeof PROBLEM_CODES)[number];

/** The codes worth trying again as they are: the store, the server or the network was down. */
export const RETRYABLE: ReadonlySet<string> = new Set([
  "store_unavailable",
  "overloaded",
  "unreachable",
  "ids_busy",
]);

/**
 * An error answer of `idem serve` (RFC 9457 problem), or `unreachable` when it did not answer.
 * `code` is a {@link ProblemCode}, `unreachable`, or a code this version does not know.
 */
export class IdemError extends Error {
  override readonly name = "IdemError";

  constructor(
    readonly code: ProblemCode | "unreachable" | (string & {}),
    readonly detail: string,
    readonly status: number = 0,
    /** Seconds to wait before trying again, when the server said. */
    readonly retryAfter: number | undefined = undefined,
    /** The whole problem body, with any extension members. */
    readonly body: Record<string, unknown> = {},
  ) {
    super(`${code} (${status}): ${detail}`);
  }

  /** Whether `e` is an {@link IdemError} with `code`. */
  static is(e: unknown, code: ProblemCode | "unreachable"): e is IdemError {
    return e instanceof IdemError && e.code === code;
  }
}

/**
 * A call whose first run failed with an error judged permanent: every retry of its key raises
 * this, with the first error's name and message, and never runs it again.
 */
export class PreviousFailure extends Error {
  override readonly name = "PreviousFailure";

  constructor(
    readonly errorName: string,
    readonly errorMessage: string,
  ) {
    super(`${errorName}: ${errorMessage}`);
  }
}

/**
 * The work outlived its lease and another attempt took the key over: its result was not kept
 * (the other attempt's is).
 */
export class LeaseLost extends Error {
  override readonly name = "LeaseLost";
}

/** The kept failure of a call whose result idem refused to store (too large, or not JSON):
 * it ran once, so it never runs again; every retry throws {@link PreviousFailure} of this name. */
export const NOT_KEPT = "ResultNotKept";
