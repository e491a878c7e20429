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
