"""``prefixrouter engine``: run one simulated vLLM engine as an HTTP server.

The command function :func:`engine` is typer-annotated; the main CLI registers
it (``app.command("engine")(engine)``) and ``python -m prefixrouter.simulated_engine``
runs it alone. It serves until SIGINT or SIGTERM, on uvloop when installed,
with aiohttp's access log off (the benchmarks send thousands of requests).

Once listening it prints one line on stderr::

    prefixrouter engine: serving 'tiny' on http://127.0.0.1:8001 (...)

With ``--port 0`` the line carries the port the system chose. Configuration
errors (a ``--tokenizer`` that is not a tokenizer file included) and a port
already in use print one line and exit with status 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Coroutine
from pathlib import Path
from typing import Annotated, Any

import typer
import zmq
from aiohttp import web
from rich.console import Console

from prefixrouter.addresses import listen_problem
from prefixrouter.errors import ConfigError
from prefixrouter.simulated_engine.config import DEFAULT_PROFILE, EngineServerConfig
from prefixrouter.terminal import fail

err_console = Console(stderr=True)


async def serve(config: EngineServerConfig, host: str, port: int) -> None:
    """Serve ``config`` on ``host:port`` until SIGINT or SIGTERM.

    Raises:
        OSError: If the address cannot be bound.
    """
    from prefixrouter.simulated_engine.app import SERVER_KEY, create_app

    app = create_app(config)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:  # the gateway's wording: the address and why
            raise OSError(listen_problem(host, port, exc)) from None
        bound = runner.addresses[0][1] if runner.addresses else port
        prof = app[SERVER_KEY].profile
        err_console.print(
            f"prefixrouter engine: serving {config.model!r} on http://{host}:{bound} "
            f"(profile {prof.name}, {prof.kv_blocks} KV blocks of {prof.block_size} tokens, "
            f"up to {config.effective_max_model_len:,} tokens a request, "
            f"time scale {config.time_scale:g})",
            highlight=False,
            soft_wrap=True,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):  # non-Unix
                loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()


def _run(main: Coroutine[Any, Any, None]) -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        asyncio.run(main)
        return
    uvloop.run(main)


def engine(
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port (0: any free port).")],
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    profile: Annotated[
        str, typer.Option(help="Engine profile (see `profiles`; tiny-cpu: a 4,096-token toy).")
    ] = DEFAULT_PROFILE,
    kv_blocks: Annotated[
        int | None, typer.Option(min=1, help="KV cache size in blocks (profile default).")
    ] = None,
    time_scale: Annotated[
        float, typer.Option(min=1e-6, help="Run simulated time this many times faster.")
    ] = 1.0,
    model: Annotated[str, typer.Option(help="Served model name.")] = "tiny",
    block_size: Annotated[
        int | None, typer.Option(min=1, help="Tokens per KV block (profile default).")
    ] = None,
    max_model_len: Annotated[
        int | None,
        typer.Option(min=1, help="Longest prompt + output (default: 131,072 or the KV cache)."),
    ] = None,
    default_max_tokens: Annotated[
        int, typer.Option(min=1, help="Output tokens when a request gives no max_tokens.")
    ] = 16,
    answer_tokens: Annotated[
        int | None,
        typer.Option(min=1, help="Every answer ends here on its own (default: at max_tokens)."),
    ] = None,
    engine_id: Annotated[str, typer.Option(help="Value of the `engine` metric label.")] = "0",
    tokenizer: Annotated[
        Path | None, typer.Option(help="Tokenizer JSON file or folder (default: built-in).")
    ] = None,
    kv_events_endpoint: Annotated[
        str | None,
        typer.Option(help="Publish vLLM-style KV events to this ZMQ address (router binds)."),
    ] = None,
    kv_events_topic: Annotated[
        str | None, typer.Option(help="Topic of the KV events (default kv@ENGINE_ID).")
    ] = None,
    kv_replay_endpoint: Annotated[
        str | None,
        typer.Option(help="Bind a KV-event replay socket here (vLLM's replay_endpoint)."),
    ] = None,
    served_log: Annotated[
        Path | None,
        typer.Option(help="Append one JSON line per served-request event to this file."),
    ] = None,
    fault_injection: Annotated[
        bool, typer.Option(help="Serve /admin/faults: switch engine faults on mid-run.")
    ] = False,
) -> None:
    """Serve a simulated vLLM engine: OpenAI API, vLLM metrics, real token counts."""
    try:
        config = EngineServerConfig(
            model=model,
            profile=profile,
            kv_blocks=kv_blocks,
            block_size=block_size,
            time_scale=time_scale,
            max_model_len=max_model_len,
            default_max_tokens=default_max_tokens,
            answer_tokens=answer_tokens,
            engine_id=engine_id,
            tokenizer=str(tokenizer) if tokenizer is not None else None,
            kv_events_endpoint=kv_events_endpoint,
            kv_events_topic=kv_events_topic,
            kv_replay_endpoint=kv_replay_endpoint,
            served_log=str(served_log) if served_log is not None else None,
            fault_injection=fault_injection,
        )
        _run(serve(config, host, port))
    except (ConfigError, OSError, zmq.ZMQError) as exc:
        raise fail(str(exc)) from None
    except KeyboardInterrupt:  # pragma: no cover - the signal handler normally wins
        pass
