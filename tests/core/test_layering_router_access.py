"""Only the routing core touches the Router's state: everything else goes through the Dispatcher.

An AST scan of every module of ``src/prefixrouter`` outside ``core``: no
access to a router's ``index`` or ``hasher``, no call of its methods (routing
and feedback are the dispatcher's), no reach through a dispatcher to its
router, and no import of the in-flight ledger or the index (the dispatcher is
their one caller). Which expression is a router is read from its name (the
code base calls them ``router`` or ``*_router``; the dispatcher ``dispatch``);
the scan's own test shows what it catches.
"""

from __future__ import annotations

import ast
from pathlib import Path

import prefixrouter
import prefixrouter.core

SRC = Path(prefixrouter.__file__).parent
CORE = Path(prefixrouter.core.__file__).parent

ROUTER_INTERNALS = {"index", "hasher", "cost", "policy"}
ROUTER_METHODS = {
    "route",
    "blocks_for",
    "on_routed",
    "on_rejected",
    "on_completed",
    "apply",
    "set_worker_capacity",
    "remove_worker",
    "worker_down",
    "worker_restarted",
}
PRIVATE_TO_CORE = {"InflightLedger", "PrefixIndex"}
PRIVATE_MODULES = {"prefixrouter.core.load", "prefixrouter.core.index"}


def _name(node: ast.expr) -> str | None:
    """The last name of ``x``, ``a.x`` or ``a.b.x`` (None for other expressions)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _is_router(node: ast.expr) -> bool:
    name = _name(node)
    if name is None or not name.lstrip("_").endswith("router"):
        return False
    # aiohttp's URL dispatcher is ``app.router``: not ours.
    return not (isinstance(node, ast.Attribute) and _name(node.value) == "app")


def _is_dispatch(node: ast.expr) -> bool:
    name = _name(node)
    return name is not None and "dispatch" in name


def violations(source: str) -> list[str]:
    """What ``source`` (a module outside core) does that only core may do."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            attr, value = node.attr, node.value
            if _is_router(value) and attr in ROUTER_INTERNALS | ROUTER_METHODS:
                found.append(f"line {node.lineno}: router.{attr}")
            elif _is_dispatch(value) and attr in {"router", "_router", "_ledger"}:
                found.append(f"line {node.lineno}: dispatcher.{attr}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = {a.name for a in node.names}
            if node.module in PRIVATE_MODULES or names & PRIVATE_TO_CORE:
                found.append(f"line {node.lineno}: imports {node.module}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in PRIVATE_MODULES:
                    found.append(f"line {node.lineno}: imports {a.name}")
    return found


def test_no_module_outside_core_touches_a_routers_state() -> None:
    files = [p for p in sorted(SRC.rglob("*.py")) if CORE not in p.parents]
    assert len(files) > 50
    bad = {
        str(p.relative_to(SRC)): v
        for p in files
        if (v := violations(p.read_text(encoding="utf-8")))
    }
    assert bad == {}


def test_the_scan_catches_each_kind_of_access() -> None:
    source = """
from prefixrouter.core.load import InflightLedger
from prefixrouter.core import PrefixIndex
import prefixrouter.core.index
st.router.index.blocks_of(w)
self.router.hasher = replace(hasher, block_size=32)
router.hasher.estimator.observe(1, 1)
router.on_completed(d, o, 0.0)
self._router.route(r, v, 0.0)
self.st.dispatch.router.index
dispatch._ledger.fill(v, 0.0)
"""
    flagged = {v.split(":")[0] for v in violations(source)}
    assert flagged == {f"line {n}" for n in range(2, 12)}  # every line


def test_the_scan_leaves_other_routers_and_indexes_alone() -> None:
    source = """
app.router.add_post("/v1/chat/completions", handler)
request.app.router.resources()
names.index(router)
span.index
engine.index
dispatch.index_blocks(w)
dispatch.admit(r, views, now)
"""
    assert violations(source) == []
