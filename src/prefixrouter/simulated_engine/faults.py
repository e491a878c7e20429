"""Fault injection and the served-request log of the simulated engine.

Two things a fault test needs from an engine, and a real one cannot give:

* **faults switched on mid-run** (``--fault-injection``): ``POST /admin/faults``
  with a JSON object sets what the engine does wrong from now on, ``GET``
  reads it back, and ``POST {}`` heals it. Every field is optional:

  - ``slow`` (number >= 1): the engine runs that many times slower (its time
    scale is divided by it; 1 is healthy);
  - ``status`` (an HTTP status 400-599): answer it, OpenAI-shaped, before any
    prefill (vLLM's 500 on an internal error);
  - ``malformed``: a 200 whose first event (or whole body, unstreamed) is not
    JSON, then the end of the body: an engine that crashed while writing;
  - ``truncate``: a stream that stops half-way with a clean end of body and no
    ``data: [DONE]`` (unstreamed: the JSON cut in half);
  - ``bad_usage``: usage fields of the wrong sign and type (a negative
    ``prompt_tokens``, ``cached_tokens`` past the prompt, a string count);
  - ``template_clock``: the engine's chat template writes the time ahead of
    every chat prompt (``Today Date: 07 Dec 2026 23:59:01.123456``), as a
    template that calls ``strftime_now`` does (Llama 3.2's writes the day,
    so its prompts change at midnight; this one at every request): a head
    the router never sees, which ends the engine's prefix reuse at the
    first token;
  - ``drop_kv_events`` (int): the next that many KV-event batches are not sent,
    though their sequence numbers are used (the router sees a gap; the replay
    socket still has them);
  - ``every`` (int >= 1): the per-request faults hit one request in ``every``
    (the others are healthy), so a fault can be partial.

* **what it served** (``--served-log FILE``): one JSON line per event of every
  generation request, appended with one ``write`` on an ``O_APPEND``
  descriptor, so the lines survive a ``SIGKILL`` (they are in the kernel once
  written): ``{"ev": "recv", "t", "rid", "tag"}`` when a request is read,
  ``"first"`` when its first byte is written, and ``"end"`` with ``"how"``
  (``done``, ``gone``: the client left, ``fault``: an injected fault ended it,
  ``error``: an error answered). ``t`` is ``time.monotonic()``, one clock for
  every process on the host, so a test can order an engine's events against
  its own; ``tag`` is the request's OpenAI ``user`` field, which a gateway
  forwards untouched, so a test knows which of its requests each engine saw.
  :mod:`prefixrouter.harness.faults` reads the file.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import orjson

from prefixrouter.simulated_engine.protocol import bad_request


@dataclass(slots=True)
class Faults:
    """What the engine does wrong now (module doc); the defaults are healthy."""

    slow: float = 1.0
    status: int | None = None
    malformed: bool = False
    truncate: bool = False
    bad_usage: bool = False
    template_clock: bool = False
    drop_kv_events: int = 0
    every: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def per_request(self) -> bool:
        """A fault that hits requests (not only speed or the KV feed) is on."""
        return self.status is not None or self.malformed or self.truncate or self.bad_usage


def parse_faults(body: Any) -> Faults:
    """A :class:`Faults` from ``POST /admin/faults``'s JSON (missing fields: healthy).

    Raises:
        ApiError: 400 naming the field that is unknown or of the wrong type.
    """
    if not isinstance(body, dict):
        raise bad_request("The fault settings must be a JSON object.")
    known = {f.name for f in fields(Faults)}
    for key in body:
        if key not in known:
            raise bad_request(f"Unknown fault {key!r} (known: {', '.join(sorted(known))}).", key)
    out = Faults()
    slow = body.get("slow", 1.0)
    if isinstance(slow, bool) or not isinstance(slow, (int, float)) or slow < 1:
        raise bad_request("'slow' must be a number of at least 1.", "slow")
    out.slow = float(slow)
    status = body.get("status")
    if status is not None and (
        isinstance(status, bool) or not isinstance(status, int) or not 400 <= status <= 599
    ):
        raise bad_request("'status' must be an HTTP error status (400-599) or null.", "status")
    out.status = status
    for name in ("malformed", "truncate", "bad_usage", "template_clock"):
        value = body.get(name, False)
        if not isinstance(value, bool):
            raise bad_request(f"'{name}' must be a boolean.", name)
        setattr(out, name, value)
    for name, least in (("drop_kv_events", 0), ("every", 1)):
        value = body.get(name, least)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise bad_request(f"'{name}' must be an integer of at least {least}.", name)
        setattr(out, name, value)
    return out


def bad_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """A usage object a buggy engine might send: wrong signs, a string, cached past the prompt."""
    return {
        "prompt_tokens": -prompt_tokens,
        "completion_tokens": str(completion_tokens),
        "total_tokens": None,
        "prompt_tokens_details": {"cached_tokens": 10 * prompt_tokens + 7},
    }


class ServedLog:
    """Appends the served-request events to a file (module doc); survives a ``SIGKILL``.

    Args:
        path: The file (created, appended to: a restarted engine adds its lines).
    """

    def __init__(self, path: str | Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def event(self, ev: str, rid: str, **extra: Any) -> None:
        """One line ``{"ev", "t", "rid", ...extra}``; a single ``write`` (atomic with O_APPEND)."""
        line = orjson.dumps({"ev": ev, "t": time.monotonic(), "rid": rid, **extra})
        os.write(self._fd, line + b"\n")

    def close(self) -> None:
        os.close(self._fd)
