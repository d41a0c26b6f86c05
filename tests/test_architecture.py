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
