"""The access log's file: refused at startup when it cannot be written, one warning per outage.

Unit tests of :class:`~prefixrouter.gateway.access_log.AccessLog` (the live
traffic's lines are ``test_access_log.py``'s); the CLI's one-line refusal is
in ``test_cli.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path

import orjson
import pytest

from prefixrouter.errors import ConfigError
from prefixrouter.gateway import access_log
from prefixrouter.gateway.access_log import AccessLog, RequestNote


def _note(path: str = "/v1/chat/completions") -> RequestNote:
    return RequestNote(time.time(), "POST", path, status=200, request_id="r")


def test_an_unwritable_path_is_refused_at_open(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    for path in (tmp_path, tmp_path / "file" / "under-a-file.jsonl"):
        log = AccessLog(path)
        with pytest.raises(ConfigError, match=rf"^access_log\.path: {path}: cannot write: "):
            log.open()
    ok = AccessLog(tmp_path / "new" / "a.jsonl")
    ok.open()
    assert (tmp_path / "new" / "a.jsonl").exists()
    ok.close()


def test_a_failing_file_warns_once_per_outage_counts_and_recovers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "a.jsonl"
    path.mkdir()  # a folder where the file should be: every write fails
    log = AccessLog(path)
    with caplog.at_level(logging.WARNING, logger="prefixrouter.gateway"):
        for _ in range(3):  # three flushes: one warning, not three
            log.record(_note())
            log.record(_note())
            log._write(log.take())
        log.record(_note())
        log.close()  # the shutdown path: no exception
    assert (log.dropped, log.written) == (7, 0)
    warnings = [r.getMessage() for r in caplog.records if "cannot write" in r.getMessage()]
    assert len(warnings) == 1 and str(path) in warnings[0], warnings
    path.rmdir()  # the file can be written again: the next batch is, and says so
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="prefixrouter.gateway"):
        log.record(_note())
        log._write(log.take())
    assert "access log: writing" in caplog.text and "again (7 lines dropped so far)" in caplog.text
    log.close()
    assert [orjson.loads(x)["status"] for x in path.read_bytes().splitlines()] == [200]


def test_the_flusher_keeps_running_through_an_outage(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.mkdir()
    log = AccessLog(path, flush_interval_s=0.01)

    async def body() -> None:
        task = asyncio.get_running_loop().create_task(log.run())
        for _ in range(3):
            log.record(_note())
            await asyncio.sleep(0.05)
        assert not task.done() and log.dropped == 3
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task  # its close() raises nothing

    asyncio.run(body())


def test_buffered_lines_are_bounded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(access_log, "MAX_PENDING", 2)
    log = AccessLog(tmp_path / "a.jsonl")
    for _ in range(5):
        log.record(_note())
    assert (len(log.take()), log.dropped) == (2, 3)
