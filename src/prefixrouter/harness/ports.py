"""Free loopback ports for the servers a harness starts.

Every server of a live fleet (engines, gateways, peer routers, vLLM's
replay and KV-event sockets) listens on 127.0.0.1 on a port picked here. A
port is picked *below* the kernel's ephemeral range (the source ports of
outgoing connections): a server that binds its port only later (vLLM binds
its replay socket 20-40 s after the port is picked) would otherwise find it
taken by the source port of some outgoing connection, as one run in a few
did. Within that range the pick is random, never the same port twice in one
process, and checked by binding it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

HOST = "127.0.0.1"

EPHEMERAL_FALLBACK = (32768, 60999)
"""Linux's default ``ip_local_port_range``, when the kernel's cannot be read."""

_handed_out: set[int] = set()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range of source ports for outgoing connections."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return EPHEMERAL_FALLBACK


def free_port() -> int:
    """A loopback port that was free a moment ago and stays out of the kernel's way (module doc)."""
    low = ephemeral_range()[0]
    start = 10_000 if low > 20_000 else 1024
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(start, low)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a crowded range: any port
        s.bind((HOST, 0))
        return int(s.getsockname()[1])
