// The Idempotency-Key header read as idem's HTTP layer reads it (crates/idem-http/src/header.rs,
// whose cases these are): bare or quoted, one key.

import assert from "node:assert/strict";
import { test } from "node:test";

import { KeyHeaderError, keyOf, parseKey } from "../src/key.js";

/** The IETF draft's form of `key`: an RFC 8941 string. */
const quoted = (key: string) => `"${key.replace(/["\\]/g, "\\$&")}"`;

test("both forms are accepted, parameters ignored", () => {
  assert.equal(parseKey("abc-123"), "abc-123");
  assert.equal(parseKey('"abc-123"'), "abc-123");
  assert.equal(parseKey('  "abc"\t'), "abc");
  assert.equal(parseKey('"a\\"b\\\\c"'), 'a"b\\c');
  assert.equal(parseKey('"abc";foo=1;bar;baz="x y"'), "abc");
  assert.equal(parseKey('"abc"; *x=?1'), "abc");
  // A bare key may hold characters that are special in structured fields.
  assert.equal(parseKey("a;b=c"), "a;b=c");
});

test("what is not a key is refused, never cut", () => {
  for (const [value, why] of [
    ["", /empty/],
    ["   ", /empty/],
    ['""', /empty/],
    ["a b", /quoted string/],
    ["a,b", /quoted string/],
    ['"a", "b"', /quoted string/],
    ['"a b"', /quoted string/],
    ['"abc', /quoted string/],
    ['"a\\x"', /quoted string/],
    ['"abc"x', /quoted string/],
    ['"abc";', /quoted string/],
    ['"abc";Up=1', /quoted string/],
    ['"abc";a=', /quoted string/],
    ["caf\u00e9", /quoted string/],
    ["a\x7f", /quoted string/],
    ["k".repeat(256), /longer than 255/],
    [`"${"k".repeat(300)}"`, /longer than 255/],
  ] as const) {
    assert.throws(() => parseKey(value), (e) => e instanceof KeyHeaderError && why.test(e.message), JSON.stringify(value));
  }
  assert.equal(parseKey("k".repeat(255)).length, 255);
  assert.equal(parseKey(quoted('"'.repeat(255))), '"'.repeat(255), "escapes do not count against the length");
  assert.throws(() => keyOf(["a", "a"]), /more than one/);
  assert.equal(keyOf(undefined), undefined);
});

test("every key reads back from its quoted form, and bare as it is", () => {
  const seed = Number(process.env.SEED ?? Date.now() % 1_000_000);
  let state = seed;
  const next = () => (state = (state * 1_103_515_245 + 12_345) % 2 ** 31);
  for (let i = 0; i < 2_000; i++) {
    const length = 1 + (next() % 255);
    const key = Array.from({ length }, () => String.fromCharCode(0x21 + (next() % 94))).join("");
    assert.equal(parseKey(quoted(key)), key, `seed ${seed}`);
    if (!key.includes(",") && !key.startsWith('"')) assert.equal(parseKey(key), key, `seed ${seed}`);
  }
});
