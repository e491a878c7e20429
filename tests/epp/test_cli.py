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


def test_the_grpc_port_serves_tls_with_a_certificate_and_key(tmp_path: Path) -> None:
    """A client that trusts the CA gets SERVING over TLS; a plaintext one is refused."""
    import re

    import grpc
    import trustme
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    chain, key = tmp_path / "chain.pem", tmp_path / "key.pem"
    chain.write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    key.write_bytes(cert.private_key_pem.bytes())
    cmd = [sys.executable, "-m", "prefixrouter.epp", "--port", "0", "--http-port", "0"]
    cmd += ["--tls-cert-file", str(chain), "--tls-key-file", str(key)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        match = re.search(r"listening on grpcs://(\S+)", proc.stdout.readline())
        assert match, proc.stdout
        target = match.group(1)
        creds = grpc.ssl_channel_credentials(root_certificates=ca.cert_pem.bytes())
        with grpc.secure_channel(target, creds) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(target) as plain:
            stub = health_pb2_grpc.HealthStub(plain)
            try:
                stub.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=3)
            except grpc.RpcError as exc:
                assert exc.code() in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                )
            else:
                raise AssertionError("a plaintext client was served on the TLS port")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_tls_files_are_checked_in_one_line(tmp_path: Path) -> None:
    not_pem = tmp_path / "cert.txt"
    not_pem.write_text("hello\n")
    result = CliRunner().invoke(app, ["epp", "--tls-cert-file", str(not_pem)])
    assert (
        result.exit_code == 2 and "--tls-cert-file and --tls-key-file go together" in result.output
    )
    args = ["epp", "--tls-cert-file", str(not_pem), "--tls-key-file", str(tmp_path / "none")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert f"{not_pem}: not a PEM file holding a certificate" in " ".join(result.output.split())
