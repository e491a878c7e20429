"""``python -m prefixrouter.simulated_engine --port P``: the engine server on its own."""

from __future__ import annotations

import typer

from prefixrouter.simulated_engine.cli import engine


def main() -> None:
    """Run the ``engine`` command as a standalone program."""
    typer.run(engine)


if __name__ == "__main__":
    main()
