"""The exception tree of prefixrouter.

::

    PrefixRouterError                 base of everything raised on purpose
    ├── ConfigError                   bad configuration: names the file, line and field
    ├── RoutingError                  the router could not place a request
    │   └── NoWorkerAvailable         every worker was filtered out (health, model, tenant, pool)
    └── UnknownNameError (KeyError)   an unknown policy, scenario or profile name

Callers at the edges (CLI, HTTP gateway) turn these into one-line messages or
OpenAI-style JSON errors; nothing below them prints.
"""

from __future__ import annotations

from collections.abc import Iterable
from os import PathLike


def unreadable(path: str | PathLike[str], exc: OSError) -> str:
    """The one-line message for a file that cannot be read: ``PATH: cannot read: WHY``."""
    return f"{path}: cannot read: {exc.strerror or exc}"


class PrefixRouterError(Exception):
    """Base class of every error prefixrouter raises on purpose."""


class ConfigError(PrefixRouterError, ValueError):
    """Invalid configuration or parameters; the message names the field."""


class RoutingError(PrefixRouterError):
    """A request could not be routed."""


class NoWorkerAvailable(RoutingError):
    """No worker survived the filters (health, model, adapter, tenant, pool).

    Attributes:
        filtered: Worker id -> the filter that removed it (empty: no workers).
    """

    def __init__(self, message: str, filtered: Iterable[tuple[str, str]] = ()) -> None:
        super().__init__(message)
        self.filtered: dict[str, str] = dict(filtered)


class UnknownNameError(PrefixRouterError, KeyError):
    """An unknown registered name (policy, scenario, profile)."""

    def __init__(self, kind: str, name: str, known: list[str]) -> None:
        self.kind, self.name, self.known = kind, name, known
        super().__init__(f"unknown {kind} {name!r}; known: {', '.join(sorted(known))}")

    def __str__(self) -> str:
        return str(self.args[0])
