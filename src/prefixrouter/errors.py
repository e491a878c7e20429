"""The exception tree of prefixrouter.

::

    PrefixRouterError                 base of everything raised on purpose
    ├── ConfigError                   bad configuration: names the file, line and field
    ├── RoutingError                  the router could not place a request
    │   └── NoWorkerAvailable         every worker was filtered out (health, model, tenant, pool)
    └── UnknownNameError (KeyError)   an unknown policy, scenario or profile name

Callers at the edges (CLI, HTTP gateway) turn these into one-line messages or
OpenAI-style JSON errors; nothing below them prints. The messages for files
live here too: :func:`unreadable`, :func:`unwritable`, and :func:`check_outputs`
(:func:`output_problem` for each output), which commands run on their output paths
before a long run (with :func:`same_file`, so that no output overwrites an input or
another output). So does :func:`gunzip_if_gzip`, the one reading of a file that may
be gzip, for the trace reader, the log reader and the linter.
"""

from __future__ import annotations

import gzip
import os
import zlib
from collections.abc import Iterable, Mapping
from os import PathLike
from pathlib import Path


def exception_text(exc: BaseException) -> str:
    """``Type: message`` of an exception for a log line or an error, ``Type`` alone when it
    says nothing (a bare ``TimeoutError()`` printed as ``TimeoutError: `` with nothing after)."""
    said = str(exc)
    return f"{type(exc).__name__}: {said}" if said else type(exc).__name__


def unreadable(path: str | PathLike[str], exc: OSError) -> str:
    """The one-line message for a file that cannot be read: ``PATH: cannot read: WHY``."""
    return f"{path}: cannot read: {exc.strerror or exc}"


def unwritable(path: str | PathLike[str], exc: OSError) -> str:
    """The one-line message for a file that cannot be written: ``PATH: cannot write: WHY``."""
    return f"{path}: cannot write: {exc.strerror or exc}"


def output_problem(
    path: Path, *, suffix: str | None = None, taken: Mapping[str, Path | None] | None = None
) -> str | None:
    """Why ``path`` cannot be written as an output file, or None if it looks writable.

    Commands check their ``--json`` / ``--plot`` paths with this before a long
    run, so that a typo costs seconds, not the run. It creates nothing: the
    missing folders are made only when the file is written. A write can still
    fail (a full disk); callers catch :class:`OSError` there too.

    Args:
        path: The file to be written.
        suffix: The extension the file must have (``".png"``), compared
            case-insensitively; a writer that appends its own extension to a
            name without one would otherwise write another file than the one named.
        taken: Files the output must not be, by what they are (``{"the trace it
            reads": trace, "the --json output": json_out}``; None values are
            skipped): an input the run reads would be overwritten with its
            report, and two outputs in one file leave only the last.
    """
    if path.is_dir():
        return "is a directory"
    for what, other in (taken or {}).items():
        if other is not None and same_file(path, other):
            return f"is {what}"
    if suffix is not None and path.suffix.lower() != suffix:
        return f"expected a file name ending in {suffix}"
    # The nearest existing folder above it must be a writable folder (the rest is made).
    parent = path.parent
    while not parent.exists():
        if parent == parent.parent:
            break
        parent = parent.parent
    if parent.exists() and not parent.is_dir():
        return f"{parent} is not a folder"
    if path.exists():
        if not os.access(path, os.W_OK):
            return "permission denied"
    elif parent.exists() and not os.access(parent, os.W_OK | os.X_OK):
        return f"permission denied in {parent}"
    return None


def check_outputs(
    outputs: Iterable[tuple[str, Path | None, str | None]],
    inputs: Mapping[str, Path | None] | None = None,
) -> str | None:
    """The message for the first output that cannot be written, or None if all look writable.

    Each output is ``(option, path, suffix)`` (``("--plot", plot, ".png")``; a None
    path is an option not given) and is checked with :func:`output_problem`: it may
    not be one of ``inputs`` (``{"the trace it reads": trace}``), whose report
    would overwrite it, nor an output named before it, since two outputs in one
    file leave only the last. The message is ``OPTION PATH: why``.
    """
    taken: dict[str, Path | None] = dict(inputs or {})
    for option, path, suffix in outputs:
        if path is None:
            continue
        if (why := output_problem(path, suffix=suffix, taken=taken)) is not None:
            return f"{option} {path}: {why}"
        taken[f"the {option} output"] = path
    return None


def same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file: the same file if both exist (hard and
    symbolic links included), else the same absolute path once resolved."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet), or cannot be looked at
        return a.resolve() == b.resolve()


GZIP_MAGIC = b"\x1f\x8b"
"""The first bytes of a gzip file (RFC 1952): files are known as gzip by these, not by
their name (a gzipped log called ``.jsonl`` would otherwise read as invalid JSON)."""


def gunzip_if_gzip(raw: bytes) -> bytes:
    """``raw`` decompressed if it starts with :data:`GZIP_MAGIC`, else ``raw`` itself.

    Raises:
        ValueError: It is gzip but truncated or damaged: ``not a valid gzip file: WHY``
            (callers wrap it in their own error, which names the file).
    """
    if raw[: len(GZIP_MAGIC)] != GZIP_MAGIC:
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:  # BadGzipFile, a cut or a corrupt stream
        raise ValueError(f"not a valid gzip file: {exc}") from exc


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
