"""Large JSON bodies parsed in slices: the same value and the same errors as ``orjson.loads``."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixrouter.gateway import body as body_mod
from prefixrouter.gateway.body import SLICE_BYTES, loads

# Slices of a few bytes: every body below is cut many times.
SMALL = (1, 3, 8)


def _same(raw: bytes, slice_bytes: int) -> None:
    """``loads`` returns what orjson returns, or raises what orjson raises."""
    try:
        want: Any = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        with pytest.raises(orjson.JSONDecodeError) as got:
            loads(raw, slice_bytes)
        assert str(got.value) == str(exc)
        return
    got_value = loads(raw, slice_bytes)
    assert got_value == want
    assert orjson.dumps(got_value) == orjson.dumps(want)  # key order, types (1 vs 1.0)


def _calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every document the body module hands orjson."""
    sizes: list[int] = []
    real = orjson.loads

    def spy(data: bytes) -> Any:
        sizes.append(len(data))
        return real(data)

    monkeypatch.setattr("prefixrouter.gateway.body.orjson.loads", spy)
    return sizes


def test_a_long_prompt_array_is_parsed_in_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    ids = list(range(0, 400_000, 3))
    raw = orjson.dumps({"model": "tiny", "prompt": ids, "max_tokens": 1})
    sizes = _calls(monkeypatch)
    assert loads(raw) == {"model": "tiny", "prompt": ids, "max_tokens": 1}
    # No call parses the whole body: each slice is about SLICE_BYTES (cut at
    # the next comma), the rest of the body one small document.
    assert len(sizes) > len(raw) // SLICE_BYTES
    assert max(sizes) <= SLICE_BYTES + 16


@pytest.mark.parametrize(
    "raw",
    [
        # nested "prompt" key: the top-level one is not an array of numbers
        b'{"meta": {"prompt": [1, 2, 3, 4, 5, 6]}, "prompt": "text"}',
        b'{"meta": {"prompt": [1, 2, 3, 4, 5, 6]}, "prompt": []}',
        b'{"meta": {"prompt": [1, 2, 3, 4, 5, 6]}}',
        # duplicate keys: orjson keeps the last
        b'{"prompt": [1, 2, 3, 4, 5, 6], "prompt": [7]}',
        b'{"prompt": [1, 2, 3, 4, 5, 6], "\\u0070rompt": []}',
        b'{"prompt": "x", "prompt": [1, 2, 3, 4, 5, 6]}',
        b'{"prompt": [1, 2, 3, 4, 5, 6], "prompt": [7, 8, 9, 10, 11, 12]}',
        # strings holding what the search looks for
        b'{"text": "\\"prompt\\": [1, 2, 3, 4, 5]", "prompt": [1, 2, 3, 4, 5, 6]}',
        b'{"a\\"prompt": [1, 2, 3, 4, 5, 6], "prompt": [9]}',
        b'{"a\\"prompt": [1, 2, 3, 4, 5, 6]}',
        b'["prompt", {"prompt": [1, 2, 3, 4, 5, 6]}]',
        b'{"prompt" : \n\t[ 1 ,\r\n 2 , 3 ,  4,5 ,6 ]  }',
        b'{"prompt":[]}',
        b'{"prompt":[      ]}',
        b'{"prompt":[-1,-0,0,-99999999,18446744073709551616,-9223372036854775809]}',
        b'{"prompt":[1.5,2e3,-4.25E-2,0.0,1e400,7,8,9]}',
        b'{"prompt":[[1,2,3,4],[5,6,7,8]]}',  # a batch: the plain parse
        b'{"prompt":[1,2,"3",4,5,6,7,8]}',
        b'{"prompt":[1,2,true,4,5,6,7,8]}',
        b'{"prompt":[1,2,3,4,5,6,7,8], "x": ' + body_mod._SENTINEL_JSON + b"}",
        b'{"prompt":' + body_mod._SENTINEL_JSON + b', "x": [1,2,3,4,5,6,7,8]}',
        # invalid: orjson's own error, position included
        b'{"prompt":[1,2,,3,4,5,6,7,8]}',
        b'{"prompt":[1,2,3,4,5,6,7,8,]}',
        b'{"prompt":[1,2,3,4,5,6,7,8,   ]}',
        b'{"prompt":[,1,2,3,4,5,6,7,8]}',
        b'{"prompt":[1,2,3,4 5,6,7,8]}',
        b'{"prompt":[01,2,3,4,5,6,7,8]}',
        b'{"prompt":[1,2,3,4,-,6,7,8]}',
        b'{"prompt":[1,2,3,4,5,6,7,8]',
        b'{"prompt":[1,2,3,4,5,6,7,8',
        b'{"prompt":[1,2,3,4,5,6,7,8]}}',
        b'{"prompt":[1,2,3,4,5,6,7,8]} x',
        b'{"prompt":[1,2,3,4,5,6,7,8], "model": "\xff"}',
        b'{"prompt":[1,2,3,4,5,6,7,8], "model": tiny}',
        b'{"model" "tiny", "prompt":[1,2,3,4,5,6,7,8]}',
        b'"prompt": [1,2,3,4,5,6,7,8]',
        b"",
    ],
)
@pytest.mark.parametrize("slice_bytes", SMALL)
def test_edge_cases_match_orjson(raw: bytes, slice_bytes: int) -> None:
    _same(raw, slice_bytes)


def test_the_sliced_path_is_taken_where_it_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = b'{"model": "m", "prompt" : [ 1, 2, 3, 4, 5, 6, 7, 8 ], "n": 1}'
    want = orjson.loads(raw)
    sizes = _calls(monkeypatch)
    assert loads(raw, 4) == want
    assert len(raw) not in sizes  # never the whole body
    sizes.clear()
    nested = b'{"meta": {"prompt": [1, 2, 3, 4, 5, 6]}, "prompt": []}'
    assert loads(nested, 4) == {"meta": {"prompt": [1, 2, 3, 4, 5, 6]}, "prompt": []}
    assert sizes[-1] == len(nested)  # the check failed: one plain parse decided


def _random_body(rng: random.Random) -> bytes:
    """A body with a prompt of numbers, written with random whitespace and neighbours."""
    ints = [rng.choice([rng.randrange(200_000), -rng.randrange(10**6), 2**70]) for _ in range(40)]
    prompt: Sequence[float] = ints[: rng.randrange(41)]
    if rng.random() < 0.2:
        prompt = [x + 0.5 if i % 3 == 0 else x for i, x in enumerate(prompt)]

    def ws() -> str:
        return "".join(rng.choice(" \t\n\r") for _ in range(rng.randrange(3)))

    items = ws().join(f"{ws()}{json.dumps(x)}{ws()}," for x in prompt).rstrip(",")
    fields = [f'"prompt"{ws()}:{ws()}[{items}{ws()}]']
    extra = [
        '"model": "tiny"',
        '"max_tokens": 3',
        '"x": {"prompt": [1, 2]}',
        '"s": "\\"prompt\\": ["',
    ]
    fields += rng.sample(extra, rng.randrange(len(extra) + 1))
    rng.shuffle(fields)
    return ("{" + ws() + f",{ws()}".join(fields) + ws() + "}").encode()


def test_random_bodies_and_their_mutations_match_orjson() -> None:
    rng = random.Random(12)
    for _ in range(1500):
        raw = _random_body(rng)
        _same(raw, rng.choice(SMALL))
        # One byte changed, dropped or added: mostly invalid JSON, orjson's own error.
        i = rng.randrange(len(raw))
        byte = bytes([rng.choice(b'0123456789,-.[]{} "e:x')])
        for broken in (
            raw[:i] + byte + raw[i + 1 :],
            raw[:i] + raw[i + 1 :],
            raw[:i] + byte + raw[i:],
        ):
            _same(broken, rng.choice(SMALL))


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
    | st.sampled_from(['"prompt": [1, 2]', "prompt", "[1,2]"])
)
_json = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(["prompt", "model", "a", 'a"prompt']) | st.text(max_size=4),
            inner,
            max_size=4,
        )
    ),
    max_leaves=12,
)
_ids = st.lists(st.integers(-(2**40), 2**40) | st.floats(-1e6, 1e6), max_size=30)


@settings(max_examples=400, deadline=None)
@given(
    doc=_json,
    prompt=_ids,
    indent=st.sampled_from([None, 0, 2]),
    place=st.booleans(),
    slice_bytes=st.sampled_from(SMALL),
)
def test_any_json_matches_orjson(
    doc: Any, prompt: list[Any], indent: int | None, place: bool, slice_bytes: int
) -> None:
    if place and isinstance(doc, dict):
        doc["prompt"] = prompt
    elif place:
        doc = {"wrapped": doc, "prompt": prompt}
    _same(json.dumps(doc, indent=indent).encode(), slice_bytes)
    _same(json.dumps(doc, separators=(",", ":")).encode(), slice_bytes)


def test_slice_bytes_must_be_positive() -> None:
    with pytest.raises(ValueError):
        loads(b"{}", 0)
