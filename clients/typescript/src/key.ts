/**
 * The `Idempotency-Key` request header, read as idem's HTTP layer reads it. The IETF httpapi
 * draft defines it as an RFC 8941 string (`"8e03978e-40d5-43e8-bc93-6894a57f9324"`), while
 * Stripe's clients send a bare value (`8e03978e-…`): both are accepted and are the same key. A
 * key is 1 to 255 visible ASCII characters (`!` to `~`), the quotes not counted.
 */

/** The longest key, in characters. */
export const MAX_KEY_LENGTH = 255;

/** An `Idempotency-Key` header that is not a key; the message, a sentence for the caller,
 * never repeats the value. */
export class KeyHeaderError extends Error {
  override readonly name = "KeyHeaderError";
}

const REPEATED = "The request has more than one Idempotency-Key header.";
const EMPTY = "The Idempotency-Key header is empty.";
const TOO_LONG = `The Idempotency-Key header is longer than ${MAX_KEY_LENGTH} characters.`;
const MALFORMED =
  'The Idempotency-Key header must be a quoted string ("key") or a bare key of visible ASCII characters without spaces or commas.';

/** The key of a request's header (as Node gives it), or `undefined` without one. */
export function keyOf(header: string | string[] | undefined): string | undefined {
  if (header === undefined) return undefined;
  if (Array.isArray(header)) {
    if (header.length > 1) throw new KeyHeaderError(REPEATED);
    return header[0] === undefined ? undefined : parseKey(header[0]);
  }
  return parseKey(header);
}

/** One header value: an RFC 8941 string (parameters allowed and ignored) or a bare key.
 * Surrounding spaces and tabs are ignored. */
export function parseKey(header: string): string {
  const value = header.replace(/^[ \t]+|[ \t]+$/g, "");
  let key: string;
  if (value.startsWith('"')) {
    const [content, rest] = sfString(value);
    // RFC 8941 §4.2.3.2 parameters: none is defined for this field, so they are only checked.
    if (!PARAMETERS.test(rest)) throw new KeyHeaderError(MALFORMED);
    key = content;
  } else if (value !== "" && !BARE.test(value)) {
    // A comma would be ambiguous: Node and intermediaries join repeated fields with commas.
    throw new KeyHeaderError(MALFORMED);
  } else {
    key = value;
  }
  if (key === "") throw new KeyHeaderError(EMPTY);
  if (key.length > MAX_KEY_LENGTH) throw new KeyHeaderError(TOO_LONG);
  return key;
}

/** Visible ASCII but the comma. */
const BARE = /^[!-+\--~]+$/;
/** `;` OWS key [ `=` bare-item ], repeated; a bare item is a string, or a token, number,
 * boolean or byte sequence (all runs of the characters below). */
const PARAMETERS = /^(?:; *[a-z*][a-z0-9_\-.*]*(?:=(?:"(?:[ !#-[\]-~]|\\["\\])*"|[A-Za-z0-9!#$%&'*+\-.^_`|~:/?=]+))?)*$/;

/** RFC 8941 §4.2.5: `"`, visible ASCII with `\"` and `\\` escapes, `"` (a key has no space).
 * The content and what follows it. */
function sfString(value: string): [string, string] {
  let out = "";
  for (let i = 1; ; ) {
    const c = value[i++];
    if (c === '"') return [out, value.slice(i)];
    if (c === "\\") {
      const escaped = value[i++];
      if (escaped !== '"' && escaped !== "\\") throw new KeyHeaderError(MALFORMED);
      out += escaped;
    } else if (c !== undefined && c >= "!" && c <= "~") {
      out += c;
    } else {
      throw new KeyHeaderError(MALFORMED);
    }
    if (out.length > MAX_KEY_LENGTH) throw new KeyHeaderError(TOO_LONG);
  }
}
