"""The module graph keeps its shape: no import cycles, no layer importing a higher one
(the layers are listed in ``scripts/import_graph.py`` and docs/architecture.md)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "import_graph.py"


def _graph():  # noqa: ANN202 - the script as a module
    spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_no_import_cycles_and_no_upward_imports() -> None:
    report = _graph().report()
    assert report.cycles == []
    assert [f"{e.src}:{e.line} -> {e.dst}" for e in report.upward] == []


def test_the_graph_sees_imports_hidden_in_functions(tmp_path: Path) -> None:
    """The checker itself: an import inside a function, or under TYPE_CHECKING, is an
    edge; a cycle made only of such imports is still found."""
    graph = _graph()
    pkg = tmp_path / "ember"
    (pkg / "kv").mkdir(parents=True)
    (pkg / "engine").mkdir()
    for d in (pkg, pkg / "kv", pkg / "engine"):
        (d / "__init__.py").write_text("")
    (pkg / "kv" / "manager.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from ember.engine.request import Request\n")
    (pkg / "engine" / "request.py").write_text(
        "def f():\n    from ember.kv import manager\n")
    graph.ROOT = pkg
    report = graph.report()
    assert report.cycles == [["ember.engine.request", "ember.kv.manager"]]
    assert [(e.src, e.dst) for e in report.upward] == [("ember.kv.manager",
                                                        "ember.engine.request")]
    assert [(e.src, e.hidden) for e in report.hidden] == [("ember.engine.request", True)]


# A request's progress and who may write it (docs/architecture.md, "one writer"): every
# assignment to, or in-place change of, these attributes anywhere in the package.
PROGRESS = ("token_ids", "prompt_logprobs", "kv_len")
MUTATORS = {"append", "extend", "insert", "pop", "clear", "remove", "__setitem__",
            "__delitem__", "sort", "reverse"}
WRITERS = {
    # the commit: history, prompt logprobs, the cached length
    ("ember/engine/commit.py", "Commit._append", "token_ids"),
    ("ember/engine/commit.py", "Commit.prompt_logprobs", "prompt_logprobs"),
    ("ember/engine/commit.py", "Commit.first_token", "prompt_logprobs"),
    ("ember/engine/commit.py", "Commit._cached", "kv_len"),
    # a request starts as its prompt
    ("ember/engine/request.py", "Request.__post_init__", "token_ids"),
    # the KV manager places a request's blocks (admission with a cached prefix, a fork)
    ("ember/kv/manager.py", "KVCacheManager.admit", "kv_len"),
    ("ember/kv/manager.py", "KVCacheManager.fork", "kv_len"),
    # the block table's own bookkeeping (truncate, release)
    ("ember/kv/blocks.py", "BlockTable.__init__", "kv_len"),
    ("ember/kv/blocks.py", "BlockTable.truncate", "kv_len"),
    ("ember/kv/blocks.py", "BlockTable.release", "kv_len"),
}


def _written(node: object) -> list[str]:
    """The attributes an assignment or an in-place call writes (``x.a = ..``,
    ``x.a[i] = ..``, ``x.a += ..``, ``x.a.append(..)``)."""
    import ast

    out = []
    if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
        for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
            while isinstance(t, ast.Subscript):
                t = t.value
            if isinstance(t, ast.Attribute):
                out.append(t.attr)
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and node.func.attr in MUTATORS and isinstance(node.func.value, ast.Attribute):
        out.append(node.func.value.attr)
    return out


def _progress_writers(root: Path) -> set[tuple[str, str, str]]:
    """(file, class.function, attribute) of every write of a PROGRESS attribute."""
    import ast

    found = set()
    for path in sorted((root / "ember").rglob("*.py")):
        rel = str(path.relative_to(root))
        stack: list[tuple[ast.AST, list[str]]] = [(ast.parse(path.read_text()), [])]
        while stack:
            node, scope = stack.pop()
            for child in ast.iter_child_nodes(node):
                inner = scope
                if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                    inner = [*scope, child.name]
                found |= {(rel, ".".join(scope), a) for a in _written(child) if a in PROGRESS}
                stack.append((child, inner))
    return found


def test_a_requests_progress_has_the_writers_the_design_names() -> None:
    """``token_ids``, ``prompt_logprobs`` and ``kv_len`` are written only by the commit
    (and a request's own start, and the KV manager placing its blocks): a new writer
    anywhere in ``ember/`` fails here until the design says why."""
    root = Path(__file__).resolve().parents[1]
    assert _progress_writers(root) == WRITERS


def test_the_writer_scan_sees_appends_assignments_and_subscripts(tmp_path: Path) -> None:
    pkg = tmp_path / "ember"
    pkg.mkdir()
    (pkg / "x.py").write_text(
        "class A:\n    def f(self, r):\n        r.token_ids.append(1)\n"
        "        r.block_table.kv_len = 3\n        r.prompt_logprobs[0] = None\n"
        "def g(r):\n    r.token_ids += [2]\n    r.other.append(1)\n")
    assert _progress_writers(tmp_path) == {
        ("ember/x.py", "A.f", "token_ids"), ("ember/x.py", "A.f", "kv_len"),
        ("ember/x.py", "A.f", "prompt_logprobs"), ("ember/x.py", "g", "token_ids")}
