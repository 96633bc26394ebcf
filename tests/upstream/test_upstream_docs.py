"""docs/upstream.md names every node type of the installed schema, in the right list."""
from __future__ import annotations

from pathlib import Path

from mlx_pte.ir.upstream.nodes import TRANSLATIONS
from mlx_pte.ir.upstream.reader import node_type_names

DOC = Path(__file__).resolve().parents[2] / "docs" / "upstream.md"


def test_the_user_doc_lists_each_node_type_as_translated_or_not():
    translated, untranslated = DOC.read_text().split("Not translated", 1)
    for name in node_type_names().values():
        assert f"`{name}`" in (translated if name in TRANSLATIONS else untranslated), name
