"""ember's module graph: import cycles, imports against the layer order, hidden imports.

    python scripts/import_graph.py            # the report
    python scripts/import_graph.py --edges    # every import edge as well

Every ``import`` of an ember module counts, wherever it is written (at module level,
inside a function, or under ``TYPE_CHECKING``): an import hidden in a function is
still a dependency. A cycle is a strongly connected group of modules; an upward
import is one from a lower layer of :data:`LAYERS` to a higher one. The test suite
holds both at zero (``tests/test_architecture.py``).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "ember"

# Lowest first. A module may import its own layer and the layers below it. A layer is
# a package (``ember.kv``) or a module (``ember.errors``); the longest match names a
# module's layer.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("ember.errors", "ember.filelock", "ember.prometheus", "ember.template_sandbox"),
    ("ember.kernels", "ember.tokenizer", "ember.chat_template", "ember.tool_formats"),
    ("ember.kv",),
    ("ember.models",),
    ("ember.sampling",),
    ("ember.spec",),
    ("ember.config",),
    ("ember.engine",),
    ("ember.eval", "ember.llm"),
    ("ember.server",),
    ("ember.cluster",),
    ("ember.bench",),
    ("ember.cli", "ember.__main__"),
)


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    line: int
    hidden: bool  # written inside a function or class body, not at module level


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _target(name: str, known: dict[str, Path]) -> str | None:
    """The ember module an imported name lives in (a name may be a module's attribute)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def edges(known: dict[str, Path]) -> list[Edge]:
    out = []
    for mod, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        top = {id(n) for n in tree.body}
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[:len(anchor) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                names = [f"{base}.{a.name}" for a in node.names] or [base]
            targets = {_target(n, known) for n in names if n.startswith("ember")}
            for dst in sorted(t for t in targets if t):
                if dst != mod and not mod.startswith(dst + "."):
                    out.append(Edge(mod, dst, node.lineno, id(node) not in top
                                    and not _under_type_checking(tree, node)))
    return out


def _under_type_checking(tree: ast.Module, node: ast.AST) -> bool:
    for stmt in tree.body:
        if (isinstance(stmt, ast.If) and isinstance(stmt.test, ast.Name)
                and stmt.test.id == "TYPE_CHECKING" and any(n is node for n in ast.walk(stmt))):
            return True
    return False


def layer_of(mod: str) -> int:
    best, at = -1, len(LAYERS)
    for i, names in enumerate(LAYERS):
        for name in names:
            if (mod == name or mod.startswith(name + ".")) and len(name) > best:
                best, at = len(name), i
    return at


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(10_000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@dataclass
class Report:
    edges: list[Edge]
    cycles: list[list[str]]
    upward: list[Edge]
    hidden: list[Edge]


def report() -> Report:
    known = modules()
    found = edges(known)
    graph: dict[str, set[str]] = defaultdict(set)
    for mod in known:
        graph[mod]
    for e in found:
        graph[e.src].add(e.dst)
    upward = [e for e in found if layer_of(e.dst) > layer_of(e.src)]
    return Report(found, cycles(graph), upward, [e for e in found if e.hidden])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--edges", action="store_true", help="print every import edge")
    args = ap.parse_args()
    r = report()
    if args.edges:
        for e in r.edges:
            print(f"{e.src} -> {e.dst} (line {e.line}{', hidden' if e.hidden else ''})")
    print(f"{len(modules())} modules, {len(r.edges)} import edges")
    print(f"cycles: {len(r.cycles)}")
    for c in r.cycles:
        print("  " + " <-> ".join(c))
    print(f"upward imports: {len(r.upward)}")
    for e in r.upward:
        print(f"  {e.src}:{e.line} -> {e.dst}")
    outside = [e for e in r.hidden if layer_of(e.src) < layer_of("ember.bench")]
    print(f"imports inside functions: {len(r.hidden)} ({len(outside)} outside bench and cli)")
    for e in outside:
        print(f"  {e.src}:{e.line} -> {e.dst}")


if __name__ == "__main__":
    main()
