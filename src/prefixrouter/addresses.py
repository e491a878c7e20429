"""What is wrong with a server's address, in words: the one check behind every URL a user
gives (a worker's ``url``, ``cluster.url``, ``prefixrouter top --url``), and why a
server could not listen on its own (:func:`listen_problem`).

A URL that passes is one the clients below can connect to as written: a
scheme of the caller's, a host, a port from 1 to 65535 if given, printable
ASCII (it goes into a request line and a Host header as it is), no query or
fragment. Pure: no lookup, no connection.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlsplit


def address_problem(url: str, schemes: tuple[str, ...], *, path: bool = True) -> str | None:
    """Why ``url`` is not a server's address, or None.

    Args:
        url: The address as given.
        schemes: The schemes allowed (``("http", "https")``).
        path: Whether a path may follow the host (an engine behind a reverse proxy).
    """
    if not url.startswith(tuple(f"{s}://" for s in schemes)):
        return "must start with " + " or ".join(f"{s}://" for s in schemes)
    if not (url.isascii() and url.isprintable()) or " " in url:
        return "must be printable ASCII without spaces (a host name in its xn-- form)"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:  # a port not from 0 to 65535, an unclosed "[IPv6"
        return f"is not a valid URL: {exc}"
    if not parts.hostname:
        return "has no host"
    if port == 0:
        return "has port 0, which cannot be connected to: give a port from 1 to 65535"
    if parts.query or parts.fragment or "?" in url or "#" in url:
        return "must not have a query or fragment"
    if not path and parts.path not in ("", "/"):
        return "must not have a path"
    return None


def listen_problem(host: str, port: int, exc: OSError) -> str:
    """``cannot listen on HOST:PORT: WHY`` for a bind that failed with ``exc``."""
    if isinstance(exc, socket.gaierror):
        # getaddrinfo's errno is an EAI_* code, which os.strerror reads as
        # "Unknown error -2": say what it means.
        why = f"not a valid address or a host name that resolves ({exc.strerror})"
    else:
        # asyncio's message repeats the address; the errno's own text does not.
        why = os.strerror(exc.errno) if exc.errno else str(exc)
    return f"cannot listen on {host}:{port}: {why}"
