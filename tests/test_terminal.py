"""The command line's error and note lines: one line each, the message printed as it is."""

from __future__ import annotations

import pytest

from prefixrouter.terminal import fail, note


def test_a_message_with_brackets_is_printed_as_it_is(capsys: pytest.CaptureFixture[str]) -> None:
    # Read as rich markup, '[sk-abc]' vanished and a '[/]' could raise.
    exit_ = fail("--url 'http://[::1': key [sk-abc] refused, [/] and [bold]x[/bold]")
    assert exit_.exit_code == 2
    note("--rate [2] overrides --load")
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "error: --url 'http://[::1': key [sk-abc] refused, [/] and [bold]x[/bold]",
        "note: --rate [2] overrides --load",
    ]


def test_an_exception_that_says_nothing_is_named_alone() -> None:
    """A bare ``TimeoutError()`` read ``/health: TimeoutError: `` in the log, nothing after."""
    from prefixrouter.errors import exception_text

    assert exception_text(TimeoutError()) == "TimeoutError"
    assert exception_text(ValueError("bad port")) == "ValueError: bad port"
