"""The fault accounting: lost and duplicated requests from the engines' served logs."""

from __future__ import annotations

from pathlib import Path

import orjson

from prefixrouter.harness.faults import Outcome, Served, account, leave_s, read_served, return_s


def _done(tag: str, t_send: float, t_first: float, rid: str) -> Outcome:
    return Outcome(tag, t_send, t_first, t_first + 0.1, "complete", 200, "e0", f"q-{tag}", url="",
                   engine_ids={rid})  # fmt: skip


def test_a_complete_answer_an_engine_finished_is_neither_lost_nor_duplicated() -> None:
    outs = [_done("a", 1.0, 1.2, "r1")]
    tally = account(outs, [Served("e0", "r1", "a", 1.1, 1.2, "done")])
    assert (tally.requests, tally.complete, tally.lost, tally.duplicated) == (1, 1, 0, 0)


def test_silent_and_unserved_answers_are_lost() -> None:
    silent = Outcome("s", 1.0, kind="silent", error="the stream ended without [DONE]")
    forged = _done("f", 1.0, 1.2, "r9")  # no engine finished r9
    cut = _done("c", 1.0, 1.2, "r2")
    served = [Served("e0", "r2", "c", 1.1, 1.2, None)]  # the engine died before its end
    tally = account([silent, forged, cut], served)
    assert tally.lost == 3 and tally.duplicated == 0


def test_a_request_received_after_the_first_byte_or_spliced_is_duplicated() -> None:
    late = _done("l", 1.0, 1.2, "r1")
    spliced = _done("s", 1.0, 1.2, "r2")
    spliced.engine_ids.add("r3")
    served = [
        Served("e0", "r1", "l", 1.1, 1.15, "done"),
        Served("e1", "rx", "l", 1.5, None, "gone"),  # a second engine got it after the byte
        Served("e0", "r2", "s", 1.1, 1.15, "done"),
        Served("e1", "r3", "s", 1.1, 1.15, "done"),
    ]
    assert account([late, spliced], served).duplicated == 2


def test_a_frozen_engine_reading_its_backlog_late_is_no_duplicate_unless_it_answers() -> None:
    out = _done("f", 1.0, 3.5, "r2")  # retried on e1 after e0 froze at 1.05
    served = [
        Served("e0", "r1", "f", 11.2, None, "gone"),  # e0 woke at 11.0, read it, dropped it
        Served("e1", "r2", "f", 3.4, 3.5, "done"),
    ]
    frozen = {"e0": [(1.05, 11.0)]}
    assert account([out], served, frozen).duplicated == 0
    assert account([out], served).duplicated == 1  # without the freeze it would be one
    answered = [Served("e0", "r1", "f", 11.2, 11.3, "done"), served[1]]
    assert account([out], answered, frozen).duplicated == 1


def test_leave_and_return_times() -> None:
    outs = [_done(t, s, s + 0.1, f"r{t}") for t, s in (("a", 10.0), ("b", 10.5), ("c", 12.0))]
    decisions = [
        {"request_id": "q-a", "selected_worker": "e1", "retried_from": ["e0"]},
        {"request_id": "q-b", "selected_worker": "e0", "retried_from": []},
        {"request_id": "q-c", "selected_worker": "e1", "retried_from": []},
    ]
    assert leave_s(outs, decisions, "e0", 10.0, 15.0) == 0.5
    assert leave_s(outs, decisions, "e0", 11.0, 15.0) == 0.0
    assert leave_s(outs, decisions, "e0", 10.0, 11.0) is None  # still there at the end
    served = [Served("e0", "x", "c", 12.3, 12.4, "done"), Served("e0", "y", "b", 10.6, None, "")]
    assert return_s(outs, served, "e0", 11.5) == 12.3 - 11.5
    assert return_s(outs, served, "e0", 12.5) is None


def test_read_served_skips_a_line_cut_by_a_crash(tmp_path: Path) -> None:
    log = tmp_path / "e0.jsonl"
    lines = [
        {"ev": "recv", "t": 1.0, "rid": "r1", "tag": "a"},
        {"ev": "first", "t": 1.1, "rid": "r1"},
        {"ev": "end", "t": 1.2, "rid": "r1", "how": "done"},
        {"ev": "recv", "t": 2.0, "rid": "r2", "tag": "b"},
    ]
    log.write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines) + b'{"ev": "end", "t"')
    got = {s.rid: s for s in read_served({"e0": log, "e1": tmp_path / "missing"})}
    assert got["r1"] == Served("e0", "r1", "a", 1.0, 1.1, "done")
    assert got["r2"].how is None and got["r2"].t_first is None
