/**
 * Whose a key is. The wrapper keeps each caller's keys apart, so that one caller can never be
 * given another's stored answer by sending its key: the same key from two callers names two
 * records. A caller is known by a credential (the `Authorization` header by default) or by
 * what the app says, and only a hash of it is kept, in the namespace the records are under.
 */

import { createHash } from "node:crypto";

/** The longest namespace the wrapper takes: idem's 128 characters, less the scope it adds. */
export const MAX_NAMESPACE_LENGTH = 128 - 1 - 32;

/** The namespace a caller's records are under: the route's, then `:` and 32 hex digits of
 * a SHA-256 of who the caller is (`who`), or `:anonymous` for every caller who says no one. The
 * namespace keeps the key's whole length for the key. */
export function scopedNamespace(namespace: string, source: "credential" | "app", who: string | undefined): string {
  if (who === undefined) return `${namespace}:anonymous`;
  const hash = createHash("sha256").update(`idem-client scope\0${source}\0`).update(who).digest("hex");
  return `${namespace}:${hash.slice(0, 32)}`;
}

/** The request's credential as its scope is hashed from it, or `undefined` if it has none
 * (no `Authorization` header, or a blank one). The scheme is case-insensitive (RFC 9110
 * §11.1), so `bearer x` is `Bearer x`'s scope. */
export function credential(headers: Record<string, string | string[] | undefined>): string | undefined {
  const header = headers.authorization;
  const values = (Array.isArray(header) ? header : [header]).map((v) => v?.trim() ?? "");
  if (values.every((v) => v === "")) return undefined;
  // Every line counts, so that no caller takes another's scope by adding a second one.
  return JSON.stringify(
    values.map((v) => {
      const at = v.indexOf(" ");
      return at < 0 ? v : `${v.slice(0, at).toLowerCase()} ${v.slice(at).trimStart()}`;
    }),
  );
}
