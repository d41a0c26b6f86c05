"""docs/models.md's support table is the one tests/support_table.py generates from
what the tests check."""

from __future__ import annotations

from pathlib import Path

from support_table import BEGIN, END, table


def test_the_docs_table_is_generated_from_the_tests() -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "models.md").read_text()
    assert BEGIN in doc and END in doc, "docs/models.md lost its support table markers"
    current = doc[doc.index(BEGIN):doc.index(END) + len(END)]
    assert current == table(), "regenerate: python tests/support_table.py"
