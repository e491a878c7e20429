"""Ports for servers that bind late (vLLM's sockets): outside the kernel's ephemeral range."""

from __future__ import annotations

import socket

from prefixrouter.demo import fleet


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    low, _ = fleet._ephemeral_range()
    ports = [fleet.free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(p < low for p in ports)  # never a future source port of an outgoing connection
    for p in ports[:5]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((fleet.HOST, p))
