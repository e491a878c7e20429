"""Ports for servers that bind late (vLLM's sockets): outside the kernel's ephemeral range."""

from __future__ import annotations

import socket

from prefixrouter.harness import ports


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    low, _ = ports.ephemeral_range()
    picked = [ports.free_port() for _ in range(50)]
    assert len(set(picked)) == 50
    assert all(p < low for p in picked)  # never a future source port of an outgoing connection
    for p in picked[:5]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ports.HOST, p))
