"""``prefixrouter epp`` / ``python -m prefixrouter.epp``: errors are one line and exit 2."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from prefixrouter.cli import app


def test_a_bad_config_exits_2_naming_the_file_line_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("workers:\n  - url: nope\n")
    result = CliRunner().invoke(app, ["epp", "--config", str(bad)])
    assert result.exit_code == 2
    assert f"{bad}:2: workers.0.url" in result.output


def test_a_grpc_port_in_use_is_one_line_and_exit_2() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "prefixrouter.epp", "--port", str(port), "--http-port", "0"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: cannot listen on 127.0.0.1:{port} (gRPC)")
