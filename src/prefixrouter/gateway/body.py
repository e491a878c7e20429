"""Large JSON bodies, parsed without holding the GIL for long.

``orjson.loads`` parses a document in one C call that holds the GIL from start
to end: about 120 ms for a 7.5 MB completions body whose ``prompt`` is 1.2
million token ids. Run on the parse thread, that call still stops the event
loop thread for as long, since the loop needs the GIL to answer anything.
Such a body is nearly all one flat array of numbers, and an array of numbers
can be parsed in pieces: :func:`loads` parses it in slices of about
``slice_bytes`` (a few milliseconds each), and between two slices the
interpreter's switch interval hands the GIL to the loop thread.

The algorithm, for the top-level ``prompt`` (the one field of a request that
grows this large; the gateway knows no ``prompt_token_ids``):

1. find the first ``"prompt"\\s*:\\s*[`` in the raw bytes and the first ``]``
   after it. The bytes between must be number characters only (digits,
   ``-+.eE``, commas, JSON whitespace): no string, object or nested array
   (a batch of prompts, a list of lists, takes the plain path);
2. parse the body with that span replaced by a sentinel string (a random
   token of this process, absent from the body) and check that the parsed
   top-level ``prompt`` *is* the sentinel. That settles what a regex on raw
   bytes cannot: the match may sit in a nested object, in a key that only ends
   in ``prompt`` (``"a\\"prompt"``), or be shadowed by a later duplicate key
   (orjson keeps the last one); in each case the check fails;
3. parse the span in slices cut at commas (``[`` + slice + ``]`` each) and
   put the joined list in place of the sentinel.

The result is ``orjson.loads(raw)``'s, value for value (the same numbers: an
integer past 64 bits is a float either way). Replacing one value of a valid
document by a string keeps it valid, so where step 2 or 3 fails to parse, the
body is invalid JSON; then, and wherever a step finds another shape, one plain
``orjson.loads(raw)`` decides, so an invalid body gets orjson's own error,
position included.
"""

from __future__ import annotations

import re
import secrets
from typing import Any, Final

import orjson

# About 2 ms of orjson per slice: the longest the loop thread waits behind one
# (plus the switch interval, 5 ms by default, that it waits for any holder).
SLICE_BYTES: Final = 256 * 1024
# The top-level key's array, found on the raw bytes. The quote after
# ``prompt`` is unescaped, so it ends a string: the match cannot lie wholly
# inside a string value (step 2 checks where it does lie).
_PROMPT_ARRAY: Final = re.compile(rb'"prompt"\s*:\s*\[')
# Every byte an array of numbers can hold (bytes.translate deletes them: any
# byte left over means a string, object, literal or nested array).
_NUMBER_ARRAY_BYTES: Final = b"0123456789-+.eE, \t\n\r"
# Stands in for the array in step 2: random per process, never sent anywhere.
_SENTINEL: Final = f"prefixrouter-span-{secrets.token_hex(16)}"
_SENTINEL_BYTES: Final = _SENTINEL.encode()
_SENTINEL_JSON: Final = b'"' + _SENTINEL_BYTES + b'"'


def loads(raw: bytes, slice_bytes: int = SLICE_BYTES) -> Any:
    """``orjson.loads(raw)``, with a long top-level ``prompt`` array parsed in slices.

    Args:
        raw: The body bytes.
        slice_bytes: Bytes of the array parsed per orjson call; arrays shorter
            than this are not worth slicing and take one plain parse.

    Raises:
        orjson.JSONDecodeError: Invalid JSON, exactly as ``orjson.loads`` raises it.
    """
    if slice_bytes <= 0:
        raise ValueError(f"slice_bytes must be positive, got {slice_bytes}")
    body = _sliced(raw, slice_bytes)
    return orjson.loads(raw) if body is None else body


def _sliced(raw: bytes, slice_bytes: int) -> dict[str, Any] | None:
    """The sliced parse of steps 1-3 (module docstring); None where it does not apply."""
    m = _PROMPT_ARRAY.search(raw)
    if m is None:
        return None
    lo = m.end()  # the first byte after "["
    hi = raw.find(b"]", lo)
    if hi - lo < slice_bytes:  # short, or no "]" at all (hi == -1)
        return None
    head, tail = raw[: lo - 1], raw[hi + 1 :]
    if _SENTINEL_BYTES in head or _SENTINEL_BYTES in tail:
        return None  # the span is digits: the sentinel could only be outside it
    try:
        body = orjson.loads(head + _SENTINEL_JSON + tail)
    except orjson.JSONDecodeError:
        return None
    if type(body) is not dict or body.get("prompt") != _SENTINEL:
        return None  # nested, a key ending in "prompt", or a later duplicate key
    numbers = _number_array(raw, lo, hi, slice_bytes)
    if numbers is None:
        return None
    body["prompt"] = numbers
    return body


def _number_array(raw: bytes, lo: int, hi: int, slice_bytes: int) -> list[Any] | None:
    """The array whose content is ``raw[lo:hi]``, parsed in slices cut at commas.

    None when the content holds anything but numbers, commas and whitespace,
    or is not a valid array (an empty element, a trailing comma, a malformed
    number): the caller's plain parse then names the error.
    """
    out: list[Any] = []
    start = lo
    while True:
        cut = raw.find(b",", start + slice_bytes, hi) if start + slice_bytes < hi else -1
        end = hi if cut < 0 else cut
        piece = raw[start:end]
        if piece.translate(None, _NUMBER_ARRAY_BYTES):
            return None  # a string, object, literal or nested array: another shape
        try:
            got = orjson.loads(b"[" + piece + b"]")
        except orjson.JSONDecodeError:
            return None
        if not got:  # whitespace only: valid only as the whole content ("[ ]")
            return out if start == lo and cut < 0 else None
        out.extend(got)
        if cut < 0:
            return out
        start = cut + 1  # the cut comma separates two slices: the next one must not be empty
