"""Mooncake trace replay (prefixrouter.sim.traces)."""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from prefixrouter.sim.traces import (
    TraceFormatError,
    bundled_mooncake_path,
    count_requests,
    load_mooncake,
)

ROWS = [
    {"timestamp": 0, "input_length": 1100, "output_length": 20, "hash_ids": [0, 1, 2]},
    {"timestamp": 1500, "input_length": 1300, "output_length": 0, "hash_ids": [0, 1, 3]},
    {"timestamp": 3000, "input_length": 1100, "output_length": 7, "hash_ids": [0, 1, 2]},
    {"timestamp": 3000, "input_length": 1024, "output_length": 5, "hash_ids": [0, 4]},
    {"timestamp": 6000, "input_length": 1536, "output_length": 5, "hash_ids": [0, 4, 5]},
]


def _write(path: Path, rows: Sequence[dict[str, object] | str]) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_blocks_expand_to_512_tokens_with_a_partial_last_block(tmp_path: Path) -> None:
    wl = load_mooncake(_write(tmp_path / "trace.jsonl", ROWS))
    assert [len(s) for s in wl.requests[0].segments] == [512, 512, 1100 - 1024]
    assert wl.requests[0].prompt_tokens == 1100
    assert [len(s) for s in wl.requests[3].segments] == [512, 512]
    lengths = [row["input_length"] for row in ROWS]
    assert [r.prompt_tokens for r in wl.requests] == lengths


def test_equal_hash_ids_share_one_array(tmp_path: Path) -> None:
    wl = load_mooncake(_write(tmp_path / "trace.jsonl", ROWS))
    r0, r1, r2, r3, r4 = wl.requests
    assert r0.segments[0] is r1.segments[0] is r3.segments[0]
    assert r0.segments[1] is r1.segments[1]
    assert r0.segments[2] is not r1.segments[2]
    assert r0.segments[2].tobytes() != r1.segments[2][: len(r0.segments[2])].tobytes()
    assert r0.segments[2] is r2.segments[2]  # same id, same partial length
    # Id 4 is a full block in r3 and r4; different ids give different tokens.
    assert r3.segments[1] is r4.segments[1]
    assert r0.segments[1].tobytes() != r3.segments[1].tobytes()


def test_partial_block_is_a_prefix_of_the_same_id_elsewhere(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0, 9]},
        {"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [0, 9, 10]},
    ]
    wl = load_mooncake(_write(tmp_path / "t.jsonl", rows))
    short, full = wl.requests[0].segments[1], wl.requests[1].segments[1]
    assert len(short) == 88 and len(full) == 512
    assert full.tobytes().startswith(short.tobytes())


def test_times_outputs_and_metadata(tmp_path: Path) -> None:
    path = _write(tmp_path / "trace.jsonl", ROWS)
    wl = load_mooncake(path, rate_scale=2.0, block_size=32)
    assert wl.fixed_times
    assert wl.block_size == 32
    assert wl.default_workers == 16
    assert wl.name == "trace"
    assert [r.arrival for r in wl.requests] == [0.0, 0.75, 1.5, 1.5, 3.0]
    assert [r.output_tokens for r in wl.requests] == [20, 1, 7, 5, 5]  # 0 becomes 1
    assert wl.requests[0].request_id == "trace-00001"
    assert wl.requests[0].group == "conv-1"
    assert wl.requests[0].first_user_offset == 512
    assert wl.scaled(10.0).requests[4].arrival == 3.0  # real times are not rescaled
    assert len(load_mooncake(path, limit=2).requests) == 2


def test_a_window_replays_as_if_the_file_began_there(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "trace.jsonl", [*ROWS[:2], "", *ROWS[2:]]
    )  # a blank line is no request
    assert count_requests(path) == 5
    whole = load_mooncake(path, seed=1).requests
    window = load_mooncake(path, seed=1, start=2, limit=2).requests
    assert [r.arrival for r in window] == [0.0, 0.0]  # 3.0 s into the file: its new start
    assert [r.tokens().tobytes() for r in window] == [r.tokens().tobytes() for r in whole[2:4]]
    assert [r.request_id for r in window] == [r.request_id for r in whole[2:4]]  # file lines
    tail = load_mooncake(path, start=3).requests
    assert [r.arrival for r in tail] == [0.0, 3.0]


def test_unsorted_trace_is_sorted_by_arrival(tmp_path: Path) -> None:
    wl = load_mooncake(_write(tmp_path / "t.jsonl", [ROWS[4], ROWS[0]]))
    assert [r.arrival for r in wl.requests] == [0.0, 6.0]
    assert wl.requests[0].request_id == "t-00002"


def test_gzip_file_and_stream_match_plain(tmp_path: Path) -> None:
    plain = _write(tmp_path / "trace.jsonl", ROWS)
    gz = tmp_path / "trace.jsonl.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    expected = [r.tokens().tobytes() for r in load_mooncake(plain).requests]
    assert [r.tokens().tobytes() for r in load_mooncake(gz).requests] == expected
    assert load_mooncake(gz).name == "trace"
    stream = io.BytesIO(gz.read_bytes())
    assert [r.tokens().tobytes() for r in load_mooncake(stream).requests] == expected
    text = io.StringIO(plain.read_text())
    assert [r.tokens().tobytes() for r in load_mooncake(text).requests] == expected


def test_tokens_depend_on_seed_only(tmp_path: Path) -> None:
    path = _write(tmp_path / "trace.jsonl", ROWS)
    a = [r.tokens().tobytes() for r in load_mooncake(path, seed=1).requests]
    b = [r.tokens().tobytes() for r in load_mooncake(path, seed=1).requests]
    c = [r.tokens().tobytes() for r in load_mooncake(path, seed=2).requests]
    assert a == b
    assert a != c
    # A block's tokens don't depend on which other rows were loaded.
    limited = load_mooncake(path, seed=1, limit=1).requests[0].tokens().tobytes()
    assert limited == a[0]


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ('{"timestamp": 0, "input_length": 10, "output_length": 1}', "missing field 'hash_ids'"),
        (
            '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": "0"}',
            "field 'hash_ids': expected a list of integers",
        ),
        (
            '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0.5]}',
            "field 'hash_ids'",
        ),
        (
            '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [true]}',
            "field 'hash_ids'",
        ),
        (
            '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-3]}',
            "field 'hash_ids'",
        ),
        (
            '{"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [0, 1]}',
            "field 'hash_ids': expected 3 block ids",
        ),
        (
            '{"timestamp": 0, "input_length": "10", "output_length": 1, "hash_ids": [0]}',
            "field 'input_length'",
        ),
        (
            '{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}',
            "field 'input_length'",
        ),
        (
            '{"timestamp": 0, "input_length": 10, "output_length": -1, "hash_ids": [0]}',
            "field 'output_length'",
        ),
        (
            '{"timestamp": -5, "input_length": 10, "output_length": 1, "hash_ids": [0]}',
            "field 'timestamp'",
        ),
        ('{"input_length": 10, "output_length": 1, "hash_ids": [0]}', "missing field 'timestamp'"),
        ('{"timestamp": 0, "input_length": 10,', "invalid JSON"),
        ("[1, 2, 3]", "expected a JSON object"),
    ],
)
def test_bad_lines_name_file_line_and_field(tmp_path: Path, line: str, needle: str) -> None:
    good = json.dumps(ROWS[0])
    path = _write(tmp_path / "trace.jsonl", [good, "", good, line, good])
    with pytest.raises(TraceFormatError) as info:
        load_mooncake(path)
    message = str(info.value)
    assert f"trace.jsonl:4: {needle}" in message
    assert isinstance(info.value, ValueError)


def test_empty_and_corrupt_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(TraceFormatError, match=r"empty\.jsonl: no requests"):
        load_mooncake(empty)
    corrupt = tmp_path / "bad.jsonl.gz"
    corrupt.write_bytes(b"\x1f\x8b" + b"not gzip at all")
    with pytest.raises(TraceFormatError, match=r"bad\.jsonl\.gz: not a valid gzip file"):
        load_mooncake(corrupt)
    with pytest.raises(FileNotFoundError):
        load_mooncake(tmp_path / "missing.jsonl")


def test_bad_arguments(tmp_path: Path) -> None:
    path = _write(tmp_path / "trace.jsonl", ROWS)
    for kwargs in (
        {"limit": 0},
        {"start": -1},
        {"rate_scale": 0.0},
        {"block_size": 0},
        {"seed": -1},
    ):
        with pytest.raises(ValueError):
            load_mooncake(path, **kwargs)


def test_bundled_trace_ships_with_the_package() -> None:
    path = bundled_mooncake_path()
    assert path.is_file()
    rows = gzip.decompress(path.read_bytes()).count(b"\n")
    assert rows == 12_031
    wl = load_mooncake(path, limit=100)
    assert len(wl.requests) == 100
    assert wl.name == "conversation_trace"
    assert all(r.prompt_tokens > 0 for r in wl.requests)
    assert all(r.segments[0] is wl.requests[0].segments[0] for r in wl.requests)


def test_bundled_trace_has_multi_turn_reuse() -> None:
    wl = load_mooncake(bundled_mooncake_path(), limit=400)
    # Later turns of a conversation reuse blocks past the shared block 0 (same arrays).
    seen = {id(s) for r in wl.requests[:200] for s in r.segments[1:]}
    assert any(id(s) in seen for r in wl.requests[200:] for s in r.segments[1:])


def test_a_titles_arrival_says_the_rate_scale_of_a_replayed_trace() -> None:
    """``--rate-scale 2`` replays the trace twice as fast: the title said its own times."""
    from prefixrouter.sim.report import arrival_text

    assert arrival_text({"load": None, "rate_rps": None}) == "trace arrival times"
    assert arrival_text({"rate_rps": None, "rate_scale": 2.0}) == "trace arrival times x2"
    assert arrival_text({"load": 0.9, "rate_rps": 3.0}) == "load 0.90 (3.00 req/s)"
    assert arrival_text({"rate_rps": 5.0, "rate_scale": 2.0}) == "5.00 req/s"
