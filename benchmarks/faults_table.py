"""The fault suite's scenarios, run once each, as a table: RESULTS.md's "Reliability" figures.

Runs every scenario of :mod:`prefixrouter.harness.fault_scenarios` (the ones
``tests/faults/`` asserts on) on live loopback fleets: three simulated engines
and one gateway, then two engines and two gateway replicas on a real
``nats-server``, under the same open-loop streamed load. Writes the figures
as JSON and as a Markdown table, and with ``--results`` replaces the table
between the ``<!-- faults:begin -->`` and ``<!-- faults:end -->`` markers of
``benchmarks/reliability_results.md``, which ``sim_results.py`` appends to
``benchmarks/RESULTS.md`` (never hand-typed; with ``--only``, the rows of the
scenarios not run are kept as they were)::

    PYTHONPATH=src python benchmarks/faults_table.py --json benchmarks/results/faults.json \\
        [--results benchmarks/reliability_results.md] [--only engine_sigkill,...]

Columns: requests sent; complete (``data: [DONE]``); clean errors (an
OpenAI-shaped error status or SSE error event); refused or cut (the gateway
process was down: no connection, or its connection broke); lost and
duplicated (counted from the engines' own served logs:
:func:`prefixrouter.harness.faults.account`); time for traffic to leave the
faulty engine and to return to it once restarted or thawed.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.progress import Progress

from prefixrouter.bench.marked import MarkersMissing, markers, replace_marked
from prefixrouter.harness.fault_scenarios import (
    REPLICATED,
    SINGLE,
    FaultReport,
    Scenario,
    first_complete_after,
    run_scenario,
    start_fault_fleet,
)
from prefixrouter.harness.processes import Fleet

console = Console(stderr=True)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def row(title: str, r: dict[str, Any]) -> str:
    gone = r["refused"] + r["cut"]
    cells = [title, r["requests"], r["complete"], r["clean_errors"], gone, r["lost"],
             r["duplicated"], r["leave_s"], r["return_s"]]  # fmt: skip
    return "| " + " | ".join(_fmt(c) for c in cells) + " |"


HEAD = (
    "| fault | requests | complete | clean errors | refused/cut | lost | duplicated "
    "| leave (s) | return (s) |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def markdown(rows: list[tuple[str, dict[str, Any]]]) -> str:
    return "\n".join([HEAD, *(row(t, r) for t, r in rows)])


def merged(old_block: str, rows: list[tuple[str, dict[str, Any]]]) -> str:
    """The table ``old_block`` held, its rows of ``rows``' scenarios replaced (others kept,
    in their order; scenarios it lacked appended)."""
    new = {t: row(t, r) for t, r in rows}
    lines = [ln for ln in old_block.splitlines() if ln.startswith("| ") and "---" not in ln]
    out: list[str] = []
    for ln in lines[1:]:  # after the header
        title = ln[2:].split(" | ", 1)[0]
        out.append(new.pop(title, ln))
    return "\n".join([HEAD, *out, *new.values()])


def current_block(path: Path) -> str:
    """The text between the ``faults`` markers of ``path`` ("" without them)."""
    begin, end = markers("faults")
    text = path.read_text()
    if begin not in text or end not in text:
        return ""
    return text.split(begin, 1)[1].split(end, 1)[0]


async def run_group(
    scenarios: dict[str, tuple[str, Scenario]],
    replicas: int,
    only: set[str] | None,
    progress: Progress,
) -> list[tuple[str, dict[str, Any]]]:
    todo = {k: v for k, v in scenarios.items() if only is None or k in only}
    if not todo:
        return []
    out: list[tuple[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as tmp, Fleet() as fleet:
        ff = await start_fault_fleet(
            fleet, Path(tmp), engines=2 if replicas else 3, replicas=replicas
        )
        task = progress.add_task("faults", total=len(todo))
        for key, (title, scenario) in todo.items():
            progress.update(task, description=title)
            rep: FaultReport = await run_scenario(ff, key, scenario)
            data = rep.to_dict()
            if rep.times.target in ff.gateways:
                url = ff.gateways[rep.times.target].url if replicas else None
                data["return_s"] = first_complete_after(rep.outcomes, url, rep.times.t_fault)
            out.append((title, data))
            progress.advance(task)
    return out


async def main_async(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    only = set(args.only.split(",")) if args.only else None
    with Progress(console=console, transient=False) as progress:
        rows = await run_group(SINGLE, 0, only, progress)
        rows += await run_group(REPLICATED, 2, only, progress)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--results", type=Path, help="results file whose fault table to replace")
    ap.add_argument("--only", help="comma-separated scenario keys")
    args = ap.parse_args(argv)
    if args.results and markers("faults")[0] not in args.results.read_text():
        ap.error(f"--results: {args.results} has no {markers('faults')[0]} block")
    rows = asyncio.run(main_async(args))
    table = markdown(rows)
    print(table)
    if args.results and args.only:
        table = merged(current_block(args.results), rows)
    if args.json:
        args.json.write_bytes(
            orjson.dumps([{"title": t, **r} for t, r in rows], option=orjson.OPT_INDENT_2)
        )
    if args.results:
        try:
            replace_marked(args.results, "faults", table)
        except MarkersMissing as exc:
            raise SystemExit(f"error: {exc}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
