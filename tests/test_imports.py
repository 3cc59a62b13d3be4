"""Dependencies point one way, and no two modules need each other.

Floors, lowest first: `kvstore_client` (the SDK) <- `tiers` <- `kvstore` (the daemon), with the
demo (`kvstore_demo`) and the benchmarks (`bench/`) on top. The daemon reaches the SDK only
through its shared layer, `kvstore_client.common` (errors, layout, key limits, wire formats,
shared memory, the CUDA runtime) and the generated stubs `kvstore_client._proto`, never through
the engine-side modules (the `kvstore_client.gpu` facade, the client, namespaces, paged copies).

Every import statement counts, wherever it sits: a lazy import inside a function is still an
edge, and so is a `lazy_module("a.b", ...)` / `import_module("a.b")` with a literal name. Only
imports under `if TYPE_CHECKING:` are left out (they never run). A cycle that only a lazy
import keeps from failing at import time is still a cycle; the few that remain are listed in
KNOWN_CYCLES with the reason, and the test fails once one of them is gone, so the list only
shrinks.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {                      # top-level name -> folder holding it
    "kvstore_client": ROOT / "client",
    "tiers": ROOT,
    "kvstore": ROOT,
    "kvstore_demo": ROOT,
    "bench": ROOT,
}
FLOOR = {"kvstore_client": 0, "tiers": 1, "kvstore": 2, "kvstore_demo": 3, "bench": 4}
SHARED = ("kvstore_client.common", "kvstore_client._proto")

# Cycles that remain (each entry: the modules of one cycle, and why it is still there). Empty
# now; a new one must be broken, never listed.
KNOWN_CYCLES: dict[frozenset[str], str] = {}
# Allowed exceptions to the floors, each with its reason.
UPWARD: dict[tuple[str, str], str] = {
    ("kvstore.cli", "kvstore_demo.chat"): "`kvstore demo` runs the demo, imported only then",
}


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for top, base in PACKAGES.items():
        for path in sorted((base / top).rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            if "out" in rel.parts or "__pycache__" in rel.parts:
                continue
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The module of ours that importing `name` runs (a name inside a module maps to it)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST) -> Iterator[ast.AST]:
    """ast.walk without the bodies of `if TYPE_CHECKING:`."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield other
                yield from _walk(other)
            continue
        yield child
        yield from _walk(child)


def _imports(name: str, path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: list[str] = []
    for node in _walk(tree):
        if isinstance(node, ast.Import):
            targets += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            for a in node.names:       # `from pkg import mod` imports the module pkg.mod
                sub = f"{prefix}.{a.name}"
                targets.append(sub if sub in MODULES else prefix)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            fname = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            arg = node.args[0]
            if fname in ("lazy_module", "import_module") and isinstance(arg, ast.Constant) \
                    and isinstance(arg.value, str) and not arg.value.startswith("."):
                targets.append(arg.value)
    return {t for t in map(_owner, targets) if t is not None and t != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _top(name: str) -> str:
    return name.partition(".")[0]


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(frozenset(comp))
    return found


def floor_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in graph.items():
        for dst in targets:
            if (src, dst) in UPWARD:
                continue
            s, d = _top(src), _top(dst)
            if FLOOR[d] > FLOOR[s]:
                bad.append(f"{src} imports {dst}: {d} sits above {s}")
            elif s in ("kvstore", "tiers") and d == "kvstore_client" \
                    and not dst.startswith(SHARED):
                bad.append(f"{src} imports {dst}: the daemon may use only {' and '.join(SHARED)}")
            elif src.startswith("kvstore_client.common") and not dst.startswith(SHARED):
                bad.append(f"{src} imports {dst}: the shared layer imports only itself")
    return sorted(bad)


def test_the_walk_sees_the_tree():
    assert {"kvstore.store", "tiers.ssd", "kvstore_client.common.errors",
            "kvstore_client.client", "kvstore_demo.chat"} <= set(MODULES)
    assert "kvstore_client.common.errors" in GRAPH["kvstore.store"]
    assert "tiers.codecs" in GRAPH["kvstore.moves.encoding"]   # a lazy_module("tiers.codecs")


def test_dependencies_point_one_way():
    assert floor_violations(GRAPH) == []


def test_no_module_cycles():
    cycles = _cycles(GRAPH)
    unknown = [sorted(c) for c in cycles if c not in KNOWN_CYCLES]
    assert unknown == [], "import cycles (a lazy import inside a function counts too)"
    gone = [sorted(c) for c in KNOWN_CYCLES if c not in cycles]
    assert gone == [], "cycles no longer there: remove them from KNOWN_CYCLES"


def test_the_checks_catch_a_back_edge_and_a_cycle():
    """The walk is not vacuous: an SDK module importing the daemon, the daemon importing the
    SDK's engine facade, and a pair of daemon modules importing each other are all caught."""
    graph = {k: set(v) for k, v in GRAPH.items()}
    graph["kvstore_client.common.errors"].add("kvstore.config")
    graph["tiers.host"].add("kvstore_client.gpu")
    assert any("kvstore_client.common.errors imports kvstore.config" in v
               for v in floor_violations(graph))
    assert any("tiers.host imports kvstore_client.gpu" in v for v in floor_violations(graph))
    graph = {k: set(v) for k, v in GRAPH.items()}
    graph["kvstore.config"].add("kvstore.daemon")       # the daemon imports its config
    assert any({"kvstore.config", "kvstore.daemon"} <= c for c in _cycles(graph))
