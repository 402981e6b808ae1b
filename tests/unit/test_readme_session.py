"""The README's RefitSession example is real code: it parses, and every name it imports
exists with the attributes it uses.  (The same calls run end to end in
``tests/e2e/test_worker_entrypoint.py``, through ``refit-worker``.)  Pure; nothing runs.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

from refit_worker.session import RefitSession

README = Path(__file__).resolve().parents[2] / "README.md"


def _example() -> str:
    text = README.read_text()
    marker = text.index("<!-- session-example -->")
    block = text[marker:].split("```python\n", 1)[1].split("\n```", 1)[0]
    return block


def test_example_imports_exist() -> None:
    tree = ast.parse(_example())
    imported = [
        (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    ]
    assert imported, "the example imports nothing from the library"
    for module, name in imported:
        assert module is not None
        assert hasattr(importlib.import_module(module), name), f"{module}.{name}"


def test_example_calls_match_the_session_api() -> None:
    tree = ast.parse(_example())
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "session"
    }
    assert used == {"send", "receive", "committed"}
    assert all(hasattr(RefitSession, name) for name in used)
    assert "refit_id" in inspect.signature(RefitSession.send).parameters
    assert "refit_id" in inspect.signature(RefitSession.receive).parameters
    assert hasattr(RefitSession, "from_env") and hasattr(RefitSession, "__enter__")
