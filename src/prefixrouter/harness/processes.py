"""Server subprocesses on loopback: start, stop by PID, and a fleet that stops them all.

Every live run (the demo, the bench, the real-vLLM fleet, ``benchmarks/``,
the tests' clusters) starts its servers as real subprocesses and must never
leave one behind, even when it fails half-way:

* :class:`Server`: one subprocess listening on one loopback port, with its
  output in a file (never a pipe: a chatty server could block on a full one);
* :func:`stop_process`: stop by PID, bounded: ``SIGCONT`` (a frozen process
  never handles ``SIGTERM``), ``SIGTERM``, ``grace_s`` to exit, then
  ``SIGKILL`` and at most ``kill_wait_s`` more (then it raises instead of
  hanging). A process that leads its own process group is signalled as a
  group, and whatever of its group outlived it (vLLM's engine core) is
  killed after it; :func:`kill_process` is the crash (``SIGKILL`` only);
* :class:`Fleet`: the servers of one run, started in their own sessions
  (so each is stopped with everything it spawned), health-waited with
  :func:`prefixrouter.harness.health.wait_healthy`, and stopped in reverse
  order on exit;
* :func:`spawn`: how each of them starts. A run that is killed outright
  (``SIGKILL``, the OOM killer, a CI timeout) runs no ``finally``, and its
  servers, in sessions of their own, would outlive it holding their ports
  and memory. So on Linux a server started from the main thread asks the
  kernel for ``SIGTERM`` when its parent dies (``PR_SET_PDEATHSIG``, set by
  a few lines of Python that then ``exec`` the command: same PID, same
  process; the kernel ties the signal to the *thread* that forked, so a
  server started from a worker thread, which may end first, goes without).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO

from prefixrouter.harness.health import wait_healthy
from prefixrouter.harness.ports import HOST, free_port


@dataclass
class Server:
    """One running server subprocess.

    Attributes:
        name: What messages call it.
        port: The loopback port it listens on.
        process: The subprocess.
        log: Its stdout and stderr (None: not captured here).
        log_path: The log's file name, when it has one.
    """

    name: str
    port: int
    process: subprocess.Popen[bytes]
    log: IO[bytes] | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, chars: int = 500) -> str:
        """The end of what the server wrote (stdout and stderr)."""
        if self.log is None or self.log.closed:
            return ""
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace").strip()[-chars:]


_ORPHAN_GUARD = """
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    os._exit(70)  # the parent died before the request took hold: nobody waits for us
os.execv(sys.argv[2], sys.argv[2:])
"""
"""Run by :func:`spawn` before the command: ``SIGTERM`` when the parent dies, then ``exec``."""


def spawn(
    cmd: Sequence[str],
    output: IO[bytes],
    env: Mapping[str, str] | None = None,
    *,
    new_session: bool = False,
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` (stdin from ``/dev/null``, stdout and stderr to ``output``)
    so that it ends when this process dies (module doc).

    ``new_session``: its own session and process group, stopped as a whole.
    The command is resolved first, on the ``PATH`` the child gets (``env``'s,
    as ``Popen`` looks it up), so a missing program raises
    :class:`FileNotFoundError` here, as ``Popen`` would, not in the child.
    """
    search = os.pathsep.join(os.get_exec_path(env))
    program = cmd[0] if os.sep in cmd[0] else shutil.which(cmd[0], path=search)
    if program is None:
        raise FileNotFoundError(f"no such program on PATH: {cmd[0]!r}")
    args = [program, *cmd[1:]]
    if sys.platform == "linux" and threading.current_thread() is threading.main_thread():
        args = [sys.executable, "-I", "-S", "-c", _ORPHAN_GUARD, str(os.getpid()), *args]
    return subprocess.Popen(
        args,
        stdin=subprocess.DEVNULL,
        stdout=output,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=new_session,
    )


def _leads_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except (ProcessLookupError, PermissionError):
        return False


def _signal(pid: int, sig: signal.Signals, group: bool) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)


def stop_process(
    proc: subprocess.Popen[bytes],
    grace_s: float = 5.0,
    *,
    kill_wait_s: float = 5.0,
    group: bool | None = None,
) -> int:
    """Stop ``proc`` by its PID (module doc) and return its exit status.

    Args:
        proc: The process; one that has already exited is only reaped.
        grace_s: How long ``SIGTERM`` has before ``SIGKILL``.
        kill_wait_s: How long ``SIGKILL`` has.
        group: Signal its process group (None: when it leads one, read before
            it is reaped).

    Raises:
        subprocess.TimeoutExpired: It outlived ``SIGKILL`` by ``kill_wait_s``
            (a process stuck in the kernel): never a silent hang.
    """
    as_group = _leads_group(proc.pid) if group is None else group
    if proc.poll() is None:
        _signal(proc.pid, signal.SIGCONT, as_group)
        _signal(proc.pid, signal.SIGTERM, as_group)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            _signal(proc.pid, signal.SIGKILL, as_group)
            proc.wait(kill_wait_s)
    if as_group:
        # Members of its group that outlived it. The group id cannot name
        # another group meanwhile: Linux does not reuse a PID while a group
        # of that id has members.
        _signal(proc.pid, signal.SIGKILL, True)
    return int(proc.returncode)


def kill_process(proc: subprocess.Popen[bytes], kill_wait_s: float = 5.0) -> int:
    """Kill ``proc`` at once, as a crash would: ``SIGKILL`` to it (its group when it
    leads one), then reap it; returns its exit status.

    Raises:
        subprocess.TimeoutExpired: It outlived ``SIGKILL`` by ``kill_wait_s``.
    """
    _signal(proc.pid, signal.SIGKILL, _leads_group(proc.pid))
    return int(proc.wait(kill_wait_s))


@dataclass
class Fleet:
    """The servers of one run; :meth:`stop_all` (or leaving the ``with``) stops every one."""

    servers: list[Server] = field(default_factory=list)

    def start(
        self,
        name: str,
        module: str,
        args: Sequence[str],
        port: int | None = None,
        env: Mapping[str, str] | None = None,
    ) -> Server:
        """Start ``python -m module --port P args...`` and return it (not yet healthy)."""
        port = port or free_port()
        return self.start_command(
            name, [sys.executable, "-m", module, "--port", str(port), *args], port, env
        )

    def start_command(
        self,
        name: str,
        cmd: Sequence[str],
        port: int,
        env: Mapping[str, str] | None = None,
        *,
        log_path: Path | None = None,
    ) -> Server:
        """Start any server command that listens on ``port``; return it (not yet healthy).

        ``env`` adds environment variables (secrets go there: a command line
        is visible to every local user). ``log_path`` keeps the output in
        that file (appended, after a ``$ command`` line) instead of a
        temporary one.
        """
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        log: IO[bytes]
        if log_path is None:
            log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        else:
            log = log_path.open("a+b")
            log.write(f"$ {' '.join(cmd)}\n".encode())
            log.flush()
        proc = spawn(cmd, log, full_env, new_session=True)  # stopped as a whole
        server = Server(name, port, proc, log, log_path)
        self.servers.append(server)
        return server

    async def wait_healthy(self, servers: Sequence[Server], timeout_s: float = 60.0) -> None:
        """:func:`~prefixrouter.harness.health.wait_healthy` without blocking the event loop."""
        await asyncio.to_thread(wait_healthy, servers, timeout_s)

    def stop(self, server: Server, grace_s: float = 5.0) -> None:
        """Stop one server and its process group (:func:`stop_process`); close its log."""
        try:
            stop_process(server.process, grace_s, group=True)
        finally:
            if server.log is not None:
                server.log.close()
            if server in self.servers:
                self.servers.remove(server)

    def stop_all(self) -> None:
        """Stop every server, the last started first."""
        for server in list(reversed(self.servers)):
            self.stop(server)

    def __enter__(self) -> Fleet:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop_all()
