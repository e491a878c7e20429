"""The file under the gateway's logs: JSON lines appended in batches, never a stop.

The decision log (:mod:`.decision_log`) and the access log (:mod:`.access_log`)
buffer their lines in memory and hand them to a :class:`LogFile` in batches.
It owns what happens at the file:

* :meth:`LogFile.open` at the gateway's start: a path that cannot be
  written (a folder, no permission, a file where a folder should be) stops
  the start with one line naming the setting, the path and why
  (:func:`~prefixrouter.errors.unwritable`), not a warning at every flush.
* :meth:`LogFile.write` later never raises :class:`OSError`: a batch that
  cannot be written (a full disk, a file removed from under it) is dropped
  and counted in :attr:`LogFile.dropped`, one warning says so per outage (not
  one per batch), the next batch reopens the file, and one more line says
  when it is written again.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import IO

from prefixrouter.errors import ConfigError, unwritable

log = logging.getLogger("prefixrouter.gateway")


class LogFile:
    """An append-only file of lines, written in batches (module docstring).

    Not safe for two writers at once: each log has one flusher.

    Args:
        path: The file (appended; its folder is made).
        name: The log's name in warnings (``"access log"``).
        setting: The configuration key of ``path``, in the startup error
            (``"access_log.path"``).
        unit: What a line is, in warnings (``"records"``, ``"lines"``).
    """

    def __init__(self, path: Path, name: str, setting: str, unit: str = "lines") -> None:
        self.path = path
        self.name = name
        self.setting = setting
        self.unit = unit
        self._file: IO[bytes] | None = None
        self._failing = False
        self.written = 0
        """Lines written."""
        self.dropped = 0
        """Lines that never reached the file; a log adds those it dropped before the write."""

    def open(self) -> None:
        """Open the file for append now (the gateway's startup).

        Raises:
            ConfigError: It cannot be opened for append; the message names
                the setting, the path and why.
        """
        if self._file is not None:
            return
        try:
            self._file = self._open()
        except OSError as exc:
            raise ConfigError(f"{self.setting}: {unwritable(self.path, exc)}") from None

    def _open(self) -> IO[bytes]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return self.path.open("ab")

    def write(self, lines: list[bytes]) -> int:
        """Append ``lines`` (each ending in a newline); how many were written.

        Never raises :class:`OSError`: a batch that cannot be written is
        dropped and counted (module docstring), and 0 is returned.
        """
        if not lines:
            return 0
        try:
            if self._file is None:
                self._file = self._open()
            self._file.write(b"".join(lines))
            self._file.flush()
        except OSError as exc:
            self.dropped += len(lines)
            self.close()  # reopened by the next batch: the file may come back
            if not self._failing:  # once per outage, not once per batch
                self._failing = True
                log.warning(
                    "%s: cannot write %s: %s; %s are dropped until it can be",
                    self.name,
                    self.path,
                    exc.strerror or exc,
                    self.unit,
                )
            return 0
        if self._failing:
            self._failing = False
            log.warning(
                "%s: writing %s again (%d %s dropped so far)",
                self.name,
                self.path,
                self.dropped,
                self.unit,
            )
        self.written += len(lines)
        return len(lines)

    def close(self) -> None:
        """Close the file (a later :meth:`write` reopens it); never raises."""
        file, self._file = self._file, None
        if file is not None:
            with contextlib.suppress(OSError):  # it flushes its buffer: may fail as the write did
                file.close()
