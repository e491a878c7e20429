"""The routing core must stay pure: no asyncio, sockets, HTTP or clock reads."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import prefixrouter.core

CORE = Path(prefixrouter.core.__file__).parent
FORBIDDEN = {
    "asyncio", "socket", "selectors", "ssl", "http", "urllib", "aiohttp", "httpx",
    "requests", "uvloop", "zmq", "time", "datetime", "threading", "subprocess",
}  # fmt: skip


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_core_modules_import_nothing_impure() -> None:
    files = sorted(CORE.rglob("*.py"))
    assert len(files) >= 10
    assert CORE / "dispatch.py" in files  # the one driver of the core's state is pure too
    for path in files:
        bad = _imports(path) & FORBIDDEN
        assert not bad, f"{path.relative_to(CORE)} imports {sorted(bad)}"


def test_importing_core_loads_no_event_loop_or_sockets() -> None:
    code = (
        "import sys, prefixrouter.core, prefixrouter.core.policies;"
        "bad = {'asyncio', 'socket', 'aiohttp', 'zmq'} & set(sys.modules);"
        "print(sorted(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_purity_check_detects_a_forbidden_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import time\nfrom asyncio import sleep\n")
    assert _imports(bad) & FORBIDDEN == {"time", "asyncio"}
