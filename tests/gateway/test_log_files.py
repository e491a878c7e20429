"""The gateway's two log files, the decision log and the access log, over one :class:`LogFile`:
refused at startup when they cannot be written, then one warning per outage, counted drops,
a flusher that keeps running and a bounded buffer. Each test runs for both logs.

Their records' contents are ``test_decision_log.py``'s and ``test_access_log.py``'s;
the CLI's one-line refusal is in ``test_cli.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from prefixrouter.errors import ConfigError
from prefixrouter.gateway import access_log, decision_log
from prefixrouter.gateway.access_log import AccessLog, RequestNote
from prefixrouter.gateway.decision_log import DecisionLog
from tests.gateway.test_decision_log import _decision, _outcome


@dataclass(frozen=True)
class Kind:
    """One log, as these tests drive it."""

    make: Callable[[Path, float], Any]  # (path, flush interval) -> the log
    add: Callable[[Any], None]  # record one line
    flush: Callable[[Any], None]  # write what is buffered, as the flusher does
    pending: Callable[[Any], int]
    module: ModuleType  # where its MAX_PENDING is
    setting: str
    unit: str


def _access_note() -> RequestNote:
    return RequestNote(time.time(), "POST", "/v1/chat/completions", status=200, request_id="r")


ACCESS = Kind(
    make=lambda path, every: AccessLog(path, flush_interval_s=every),
    add=lambda log: log.record(_access_note()),
    flush=lambda log: log._write(log.take()),
    pending=lambda log: len(log._pending),
    module=access_log,
    setting="access_log.path",
    unit="lines",
)
DECISION = Kind(
    make=lambda path, every: DecisionLog(path, flush_interval_s=every),
    add=lambda log: log.record(_decision(), _outcome()),
    flush=lambda log: log.flush(),
    pending=lambda log: len(log._pending),
    module=decision_log,
    setting="decision_log.path",
    unit="records",
)
KINDS = pytest.mark.parametrize("kind", [ACCESS, DECISION], ids=["access", "decision"])


@KINDS
def test_an_unwritable_path_is_refused_at_open(kind: Kind, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    for path in (tmp_path, tmp_path / "file" / "under-a-file.jsonl"):
        with pytest.raises(ConfigError, match=rf"^{kind.setting}: {path}: cannot write: "):
            kind.make(path, 1.0).open()
    ok = kind.make(tmp_path / "new" / "log.jsonl", 1.0)
    ok.open()
    assert (tmp_path / "new" / "log.jsonl").exists()
    ok.close()


@KINDS
def test_a_failing_file_drops_and_counts_warns_once_and_recovers(
    kind: Kind, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "log.jsonl"
    path.mkdir()  # a folder where the file should be: every write fails
    log = kind.make(path, 1.0)
    with caplog.at_level(logging.WARNING, logger="prefixrouter.gateway"):
        for _ in range(3):  # three flushes: one warning, not three
            kind.add(log)
            kind.add(log)
            kind.flush(log)
        kind.add(log)
        log.close()  # the shutdown path: no exception
    assert (log.dropped, log.written, kind.pending(log)) == (7, 0, 0)  # nothing piles up
    warnings = [r.getMessage() for r in caplog.records if "cannot write" in r.getMessage()]
    assert len(warnings) == 1 and str(path) in warnings[0], warnings
    path.rmdir()  # the file can be written again: the next batch is, and says so
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="prefixrouter.gateway"):
        kind.add(log)
        kind.flush(log)
    assert f"again (7 {kind.unit} dropped so far)" in caplog.text
    log.close()
    assert len(path.read_bytes().splitlines()) == 1


@KINDS
def test_the_flusher_keeps_running_through_an_outage(kind: Kind, tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    path.mkdir()
    log = kind.make(path, 0.01)

    async def body() -> None:
        task = asyncio.get_running_loop().create_task(log.run())
        for _ in range(3):
            kind.add(log)
            await asyncio.sleep(0.05)
        assert not task.done() and log.dropped == 3
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task  # its close() raises nothing

    asyncio.run(body())


@KINDS
def test_buffered_lines_are_bounded(
    kind: Kind, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(kind.module, "MAX_PENDING", 2)
    log = kind.make(tmp_path / "log.jsonl", 1.0)
    for _ in range(5):
        kind.add(log)
    assert (kind.pending(log), log.dropped) == (2, 3)
