"""Stop by PID with real subprocesses: polite ones, stubborn ones, frozen ones, their children."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prefixrouter.harness.processes import Fleet, kill_process, stop_process

# Prints its child's PID, then sleeps; ignores SIGTERM when asked to.
SLEEPER = """
import signal, subprocess, sys, time
if "stubborn" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(child.pid, flush=True)
time.sleep(600)
"""


def _gone(pid: int, within_s: float = 5.0) -> bool:
    """Whether ``pid`` ended (a zombie not yet reaped by its new parent counts as ended)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        stat = Path(f"/proc/{pid}/stat")
        if stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return True
        time.sleep(0.05)
    return False


def _sleeper(*flags: str, session: bool = True) -> tuple[subprocess.Popen[bytes], int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", SLEEPER, *flags],
        stdout=subprocess.PIPE,
        start_new_session=session,
    )
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    return proc, child


def test_a_polite_process_and_its_group_stop_on_sigterm() -> None:
    proc, child = _sleeper()
    assert stop_process(proc, 5.0) == -signal.SIGTERM
    assert _gone(child)  # the whole group, not only the leader


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace() -> None:
    proc, child = _sleeper("stubborn")
    t0 = time.monotonic()
    assert stop_process(proc, 0.5) == -signal.SIGKILL
    assert time.monotonic() - t0 < 5.0
    assert _gone(child)


def test_a_frozen_process_is_woken_to_take_sigterm() -> None:
    proc, child = _sleeper()
    os.kill(proc.pid, signal.SIGSTOP)
    assert stop_process(proc, 5.0) == -signal.SIGTERM
    assert _gone(child)


def test_a_process_without_its_own_group_is_signalled_alone() -> None:
    proc, child = _sleeper(session=False)  # in this test's group: never signal that
    try:
        assert stop_process(proc, 5.0) == -signal.SIGTERM
        assert not _gone(child, within_s=0.2)  # its child is not in a group of its own
    finally:
        os.kill(child, signal.SIGKILL)


def test_an_exited_process_is_only_reaped() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(7)"])
    proc.wait()
    assert stop_process(proc) == 7


def test_kill_is_a_crash_of_the_whole_group() -> None:
    proc, child = _sleeper("stubborn")
    assert kill_process(proc) == -signal.SIGKILL
    assert _gone(child)


def test_the_fleet_stops_every_server_on_exit_even_after_an_error() -> None:
    with pytest.raises(RuntimeError, match="half-way"), Fleet() as fleet:
        servers = [
            fleet.start_command(f"s{i}", [sys.executable, "-c", SLEEPER], port=1) for i in range(2)
        ]
        raise RuntimeError("failed half-way")
    assert all(not s.alive() for s in servers)
    assert fleet.servers == []


# A run that starts a server through a Fleet, prints its PID and waits to be killed.
RUN = """
import os, sys, time
from prefixrouter.harness.processes import Fleet
fleet = Fleet()
server = fleet.start_command("s", [sys.executable, "-c", "import time; time.sleep(600)"], port=1)
print(server.pid, flush=True)
time.sleep(600)
"""


def test_a_server_ends_when_its_run_is_killed_outright() -> None:
    run = subprocess.Popen([sys.executable, "-c", RUN], stdout=subprocess.PIPE)
    assert run.stdout is not None
    server_pid = int(run.stdout.readline())
    try:
        # The guard exec'd the command: the PID the fleet holds is the server's own.
        deadline = time.monotonic() + 10
        while "time.sleep(600)" not in Path(f"/proc/{server_pid}/cmdline").read_text():
            assert time.monotonic() < deadline, "the guard never exec'd the command"
            time.sleep(0.05)
        kill_process(run)  # SIGKILL: no finally, no Fleet.stop_all
        assert _gone(server_pid), "the server outlived its run"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server_pid, signal.SIGKILL)
        kill_process(run)


def test_a_missing_program_fails_at_once_in_the_caller() -> None:
    with Fleet() as fleet, pytest.raises(FileNotFoundError, match="no-such-program-here"):
        fleet.start_command("s", ["no-such-program-here", "--port", "1"], port=1)
