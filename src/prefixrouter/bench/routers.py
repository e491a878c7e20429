"""The routers the benchmark compares, where the peers are installed, and how to start each.

Seven routers, each started as its own process on loopback in front of the same
workers:

* ``round_robin`` and ``prefix_aware``: our gateway (``python -m
  prefixrouter.gateway``) with that policy, default configuration (text mode);
* ``prefix_aware-token``: our gateway in token mode (``routing.mode: token``,
  the project's tokenizer, which the simulated engines and the tiny vLLM model use);
* ``oracle``: each document pinned to one engine in advance, from the
  workload itself (:mod:`prefixrouter.bench.oracle`; the bench writes its pin file);
* ``sglang-cache_aware`` and ``sglang-round_robin``: sglang-router (PyPI
  ``sglang-router==0.3.2``), ``python -m sglang_router.launch_router``, its own
  defaults, ``--model-path`` set to the project's local tokenizer folder so it
  never tries to download one;
* ``vllm-cache_aware``: vllm-router (PyPI ``vllm-router==0.1.17``), its own defaults.

Any other registered policy runs in our gateway as ``gateway:NAME`` (say
``gateway:ray_prefix_affinity``, one engine per document by bounded-load
hashing), so a peer's rule is measured live on our own data path.

Our gateway's routers may also run as replicas: ``prefix_aware@4`` is four
gateway processes on one nats-server the bench starts (``--cluster``, one
``--replica-id`` each), sharing routing facts; ``prefix_aware@4-nosync`` is
four that share nothing. The client sends replicas the requests round robin,
as a Kubernetes Service spreads them (``prefixrouter bench --replicas N
[--no-sync]`` turns every gateway router into such a group).

Peers live in their own virtual environments, ``<peers dir>/sglang-router`` and
``<peers dir>/vllm-router``, made by ``scripts/install_peers.sh``. The peers dir
is ``--peers-dir``, else ``$PREFIXROUTER_PEERS_DIR``, else ``./.venvs`` or the
source checkout's ``.venvs`` (whichever exists). A peer whose venv is missing is
*skipped* with the command that installs it, never silently.

Each peer gets its own Prometheus port (both default to 29000) and a quiet log
level (their INFO logs write a line per request, which costs CPU the other
routers do not pay).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from prefixrouter.core.dispatch import RoutingMode
from prefixrouter.errors import ConfigError

HOST = "127.0.0.1"
PEERS_ENV = "PREFIXROUTER_PEERS_DIR"
INSTALL_SCRIPT = "scripts/install_peers.sh"

Kind = Literal["gateway", "sglang", "vllm", "oracle"]


@dataclass(frozen=True, slots=True)
class Peer:
    """A peer router package installed from PyPI into its own venv."""

    package: str
    version: str
    venv: str

    def install_command(self, peers_dir: Path) -> str:
        """The shell command that installs this peer where the benchmark looks."""
        venv = peers_dir / self.venv
        return (
            f"{INSTALL_SCRIPT} (or: python3 -m venv {venv} && "
            f"{venv}/bin/pip install {self.package}=={self.version})"
        )


PEERS: dict[str, Peer] = {
    "sglang": Peer("sglang-router", "0.3.2", "sglang-router"),
    "vllm": Peer("vllm-router", "0.1.17", "vllm-router"),
}


@dataclass(frozen=True, slots=True)
class RouterSpec:
    """One router of the comparison.

    Attributes:
        name: Key on the command line and in the JSON.
        kind: Which program.
        policy: Its routing policy.
        config: Our gateway's YAML configuration (token mode, KV events ...);
            the workers still come from the command line.
        replicas: Gateway processes (ours only), each taking the client's
            requests round robin, as a Kubernetes Service spreads them.
        sync: Replicas share routing facts over NATS JetStream (a
            nats-server the bench starts); False: each learns alone.
        mode: Our gateway's routing mode when ``config`` is None (``token``:
            a configuration file that says so is written at start).
    """

    name: str
    kind: Kind
    policy: str
    config: Path | None = None
    replicas: int = 1
    sync: bool = True
    mode: RoutingMode = "text"

    @property
    def ours(self) -> bool:
        return self.kind == "gateway"

    @property
    def clustered(self) -> bool:
        """Several replicas that share facts (a nats-server is needed)."""
        return self.replicas > 1 and self.sync

    @property
    def label(self) -> str:
        """What a table shows."""
        if self.kind == "gateway":
            if self.replicas > 1:
                how = "synced" if self.sync else "not synced"
                return f"gateway {self.policy} x{self.replicas} {how}"
            return f"gateway {self.policy}" + (" (token)" if self.mode == "token" else "")
        if self.kind == "oracle":
            return "oracle (documents pinned)"
        return f"{PEERS[self.kind].package} {self.policy}"

    def replicated(self, replicas: int, sync: bool = True) -> RouterSpec:
        """This gateway router as ``replicas`` processes (named ``NAME@N``, ``NAME@N-nosync``)."""
        if not self.ours:
            raise ConfigError(f"{self.name}: only our gateway runs as replicas")
        if replicas <= 1:
            return self
        base = self.name.split("@", 1)[0]
        name = f"{base}@{replicas}" + ("" if sync else "-nosync")
        return replace(self, name=name, replicas=replicas, sync=sync)


ROUTERS: dict[str, RouterSpec] = {
    r.name: r
    for r in (
        RouterSpec("round_robin", "gateway", "round_robin"),
        RouterSpec("prefix_aware", "gateway", "prefix_aware"),
        RouterSpec("prefix_aware-token", "gateway", "prefix_aware", mode="token"),
        RouterSpec("oracle", "oracle", "pinned"),
        RouterSpec("sglang-cache_aware", "sglang", "cache_aware"),
        RouterSpec("sglang-round_robin", "sglang", "round_robin"),
        RouterSpec("vllm-cache_aware", "vllm", "cache_aware"),
    )
}


GATEWAY_PREFIX = "gateway:"
"""``gateway:NAME``: our gateway running the registered policy ``NAME``."""


def gateway_router(name: str) -> RouterSpec:
    """``gateway:POLICY``: our gateway with any registered policy (``prefixrouter policies``).

    Raises:
        ConfigError: An unknown policy (the message lists the registered ones).
    """
    from prefixrouter.core.policy import canonical_policy_name, policy_names

    policy = name.removeprefix(GATEWAY_PREFIX)
    registered = policy_names()
    resolved = canonical_policy_name(policy)
    if resolved not in registered:
        raise ConfigError(
            f"router {name!r}: unknown policy {policy!r}; registered: {', '.join(registered)}"
        )
    return RouterSpec(name, "gateway", resolved)


def parse_routers(spec: str) -> list[RouterSpec]:
    """``all`` or a comma-separated list of router names, in the given order.

    One of our gateway's routers may name replicas: ``prefix_aware@4`` (four
    processes sharing facts over NATS) or ``prefix_aware@4-nosync`` (four
    that do not), so one run compares them side by side. ``gateway:POLICY``
    is our gateway with any other registered policy (:func:`gateway_router`).

    Raises:
        ConfigError: An unknown name (the message lists the known ones), an
            unknown policy, or a bad replica count.
    """
    if spec.strip() == "all":
        return list(ROUTERS.values())
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise ConfigError("--routers: give 'all' or a comma-separated list of router names")
    out: list[RouterSpec] = []
    for name in dict.fromkeys(names):
        base, _, count = name.partition("@")
        if base.startswith(GATEWAY_PREFIX):
            router = gateway_router(base)
        elif base in ROUTERS:
            router = ROUTERS[base]
        else:
            known = ", ".join(ROUTERS)
            raise ConfigError(
                f"unknown router {name!r}; known: all, {known} "
                "(ours also NAME@N, and gateway:POLICY for any registered policy)"
            )
        if not count:
            out.append(router)
            continue
        digits, _, flag = count.partition("-")
        if not digits.isdigit() or int(digits) < 1 or flag not in ("", "nosync"):
            raise ConfigError(f"router {name!r}: write NAME@N or NAME@N-nosync, N >= 1")
        out.append(router.replicated(int(digits), sync=flag != "nosync"))
    return out


def default_peers_dir() -> Path:
    """``$PREFIXROUTER_PEERS_DIR``, else ``./.venvs`` or the source checkout's ``.venvs``."""
    env = os.environ.get(PEERS_ENV)
    if env:
        return Path(env)
    here = Path(".venvs")
    if here.is_dir():
        return here
    checkout = Path(__file__).resolve().parents[3]
    if (checkout / "pyproject.toml").is_file() and (checkout / ".venvs").is_dir():
        return checkout / ".venvs"
    return here


def skip_reason(spec: RouterSpec, peers_dir: Path) -> str | None:
    """Why ``spec`` cannot run here (with the install command), or None if it can."""
    if spec.kind in ("gateway", "oracle"):
        return None
    peer = PEERS[spec.kind]
    # The package's own console script marks a complete install (not just a venv).
    if (peers_dir / peer.venv / "bin" / peer.package).is_file():
        return None
    return f"{peer.package} not installed in {peers_dir / peer.venv}; install: " + (
        peer.install_command(peers_dir)
    )


def _peer_executable(peers_dir: Path, kind: Kind) -> Path:
    venv = peers_dir / PEERS[kind].venv / "bin"
    return venv / "python" if kind == "sglang" else venv / "vllm-router"


def router_command(
    spec: RouterSpec,
    *,
    port: int,
    workers: Sequence[str],
    peers_dir: Path,
    prometheus_port: int,
    tokenizer_dir: Path | None,
    decision_log: Path | None = None,
    cluster: tuple[str, str] | None = None,
    config: Path | None = None,
    pins: Path | None = None,
) -> list[str]:
    """The command line that starts ``spec`` on ``port`` in front of ``workers``.

    ``cluster``: (NATS URL, replica id) for one replica of a synced gateway;
    ``config``: our gateway's configuration file when ``spec.config`` is None
    (see :func:`token_config`); ``pins``: the oracle's pin file.

    Raises:
        ConfigError: sglang-router without ``tokenizer_dir`` (its ``--model-path``),
            the oracle without ``pins``.
    """
    if spec.kind == "oracle":
        if pins is None:
            raise ConfigError(f"{spec.name}: the oracle needs its pin file")
        cmd = [sys.executable, "-m", "prefixrouter.bench.oracle", "--port", str(port)]
        cmd += ["--pins", str(pins)]
        for url in workers:
            cmd += ["--worker", url]
        return cmd
    if spec.kind == "gateway":
        cmd = [sys.executable, "-m", "prefixrouter.gateway", "--port", str(port)]
        if cluster is not None:
            cmd += ["--cluster", cluster[0], "--replica-id", cluster[1]]
        cmd += ["--policy", spec.policy]
        for url in workers:
            cmd += ["--worker", url]
        if decision_log is not None:
            cmd += ["--decision-log", str(decision_log)]
        if (spec.config or config) is not None:
            cmd += ["--config", str(spec.config or config)]
        return cmd
    exe = str(_peer_executable(peers_dir, spec.kind))
    common = [
        "--host", HOST, "--port", str(port), "--policy", spec.policy,
        "--worker-urls", *workers,
        "--prometheus-host", HOST, "--prometheus-port", str(prometheus_port),
    ]  # fmt: skip
    if spec.kind == "sglang":
        if tokenizer_dir is None:
            raise ConfigError(f"{spec.name}: sglang-router needs a local tokenizer folder")
        return [
            exe, "-m", "sglang_router.launch_router", *common,
            "--model-path", str(tokenizer_dir), "--log-level", "warn",
        ]  # fmt: skip
    return [exe, *common, "--log-level", "warning"]


TOKEN_CONFIG = "routing:\n  mode: token\n"


def token_config(folder: Path) -> Path:
    """A gateway configuration file for token mode (the project's tokenizer), in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "token-mode.yaml"
    path.write_text(TOKEN_CONFIG)
    return path
