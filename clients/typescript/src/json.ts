/**
 * What idem keeps is JSON, so every caller of a key is given a value as JSON gives it back:
 * the first caller too, so that it never sees what a retry would not.
 */

/** The JSON text of `value` (`undefined` as `null`). Throws `TypeError` for what JSON cannot
 * hold (a BigInt, a cycle, a function) and for what it would hold only as something else:
 * NaN and Infinity (written as `null`), a Map or a Set (written as `{}`, its contents lost). */
export function toJson(value: unknown): string {
  const text: string | undefined = JSON.stringify(value ?? null, faithful);
  if (text === undefined) throw new TypeError(`a ${typeof value} is not JSON`);
  return text;
}

/** `value` as every later caller will be given it: through JSON and back (a `Date` as its
 * string, `undefined` members left out, `undefined` in an array as `null`). Throws as
 * {@link toJson} does. */
export function asJson(value: unknown): unknown {
  return JSON.parse(toJson(value));
}

function faithful(_key: string, value: unknown): unknown {
  if (typeof value === "number" && !Number.isFinite(value)) throw new TypeError(`${value} is not a JSON number`);
  if (value instanceof Map || value instanceof Set) {
    throw new TypeError(`a ${value.constructor.name} is not JSON (it would be kept as {}): give an object or an array`);
  }
  return value;
}
