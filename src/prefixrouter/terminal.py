"""The command line's one-line messages on stderr: ``error: ...`` (and the exit it asks for)
and ``note: ...``.

Every command prints its errors through :func:`fail`, so they look alike, stay on
one line whatever the terminal's width (a message is grepped and copied), and
print the message as it is: it is never read as rich markup, where a ``[...]``
in it (an IPv6 address, a key, a list) would vanish or raise.
"""

from __future__ import annotations

import typer
from rich.console import Console
from rich.text import Text

err_console = Console(stderr=True, highlight=False)
"""stderr, for progress and these lines."""


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``error: MESSAGE`` and return the exit to raise: status 2 for bad input,
    1 for a run that could not go on (a fleet that did not start)."""
    err_console.print(Text.assemble(("error:", "bold red"), " ", message), soft_wrap=True)
    return typer.Exit(code=code)


def note(message: str) -> None:
    """Print ``note: MESSAGE``: something the user asked for that has no effect."""
    err_console.print(Text.assemble(("note:", "bold yellow"), " ", message), soft_wrap=True)
