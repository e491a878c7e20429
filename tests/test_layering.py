"""The package's layering, held as ``tests/core/test_purity.py`` holds core's purity.

Two rules over the imports that run when a module is loaded (module level,
``if TYPE_CHECKING:`` blocks included: a type that points up a layer is the
same dependency on paper):

1. **No cycle**, between files or between the top-level packages of
   ``src/prefixrouter``.
2. **Layers point one way**: a module imports only from its own layer or the
   layers below it. The layers, bottom up:

   1. ``core`` (pure routing), ``errors`` and the package's ``__init__``
      (which holds the version and imports nothing: every module loads it);
   2. ``prompt`` and ``tokenization`` (the request-to-prompt path), and the
      small utilities ``stats``, ``prometheus``, ``terminal`` (the command
      line's error and note lines) and ``addresses`` (what is wrong with a URL);
   3. ``harness`` (process fleets, ports, engine resets, the replay client);
   4. ``sim``, ``simulated_engine``, ``real_engines``, ``analyze``,
      ``cluster`` (replicas' routing facts over NATS; the gateway wires it in),
      and ``discovery`` (engines found in Kubernetes; the gateway wires it in);
   5. ``gateway``, and ``epp`` (the endpoint picker behind Envoy, on the
      gateway's state: it imports the gateway, never the reverse);
   6. ``bench``, ``demo``;
   7. ``cli`` (the command line).

Imports inside functions are not counted: the command line loads its
commands lazily so that ``prefixrouter --help`` stays fast.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import prefixrouter

SRC = Path(prefixrouter.__file__).parent
ROOT = "prefixrouter"
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"core", "errors", "__init__"}),
    frozenset({"prompt", "tokenization", "stats", "prometheus", "terminal", "addresses"}),
    frozenset({"harness"}),
    frozenset({"sim", "simulated_engine", "real_engines", "analyze", "cluster", "discovery"}),
    frozenset({"gateway", "epp"}),
    frozenset({"bench", "demo"}),
    frozenset({"cli"}),
)
LAYER_OF = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def _module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _module_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements run at import: the body, and the branches of its ifs and trys."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _module_level(node.body)
            yield from _module_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                yield from _module_level(block)
            for handler in node.handlers:
                yield from _module_level(handler.body)


def import_graph(src: Path) -> dict[str, set[str]]:
    """Module -> the project modules it imports at module level."""
    files = {_module_name(p, src): p for p in sorted(src.rglob("*.py"))}
    packages = {m for m, p in files.items() if p.name == "__init__.py"}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        here = mod if mod in packages else mod.rpartition(".")[0]
        deps: set[str] = set()
        for node in _module_level(ast.parse(path.read_text(encoding="utf-8")).body):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    deps.add(sub if sub in files else base)
        graph[mod] = {d for d in deps if d in files and d != mod}
    return graph


def unit_of(module: str) -> str:
    """The top-level package or module of ``prefixrouter`` that ``module`` belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in sorted(graph.get(node, ())):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        unit = unit_of(mod)
        out.setdefault(unit, set()).update(unit_of(d) for d in deps if unit_of(d) != unit)
    return out


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in sorted(graph.items()):
        for dep in sorted(deps):
            if LAYER_OF[unit_of(dep)] > LAYER_OF[unit_of(mod)]:
                bad.append(f"{mod} (layer {LAYER_OF[unit_of(mod)] + 1}) imports {dep}")
    return bad


GRAPH = import_graph(SRC)


def test_every_package_has_a_layer() -> None:
    units = {unit_of(m) for m in GRAPH}
    assert {"core", "gateway", "sim", "cli"} <= units
    assert units <= set(LAYER_OF), f"not in any layer: {sorted(units - set(LAYER_OF))}"


def test_the_package_init_imports_nothing_of_the_project() -> None:
    assert GRAPH[ROOT] == set()


def test_no_import_cycle_between_files() -> None:
    assert cycles(GRAPH) == []


def test_no_import_cycle_between_packages() -> None:
    assert cycles(package_graph(GRAPH)) == []


def test_layers_point_one_way() -> None:
    assert upward_imports(GRAPH) == []


def test_the_checks_find_a_cycle_and_an_upward_import(tmp_path: Path) -> None:
    pkg = tmp_path / ROOT
    for sub in ("core", "gateway"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from prefixrouter.gateway import b\n"
    )
    (pkg / "gateway" / "b.py").write_text("from ..core.a import x\n")
    (pkg / "gateway" / "c.py").write_text("def f():\n    import prefixrouter.core.a\n")
    graph = import_graph(pkg)
    assert graph["prefixrouter.gateway.b"] == {"prefixrouter.core.a"}  # relative, resolved
    assert graph["prefixrouter.gateway.c"] == set()  # a function's import does not count
    assert cycles(graph) == [["prefixrouter.core.a", "prefixrouter.gateway.b"]]
    assert cycles(package_graph(graph)) == [["core", "gateway"]]
    assert upward_imports(graph) == ["prefixrouter.core.a (layer 1) imports prefixrouter.gateway.b"]
