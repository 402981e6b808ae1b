"""The README's RefitSession example is real code: it parses, and every name it imports
exists with the attributes it uses.  (The same calls run end to end in
``tests/e2e/test_worker_entrypoint.py``, through ``refit-worker``.)  Pure; nothing runs.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

from refit_worker import PolicySession, RefitSession, RolloutSession
from refit_worker.rollout.targets import RECEIVE_MODES, check_mode

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
    # linger: after the last refit, a replica that joined late still gets it.
    assert used == {"send", "receive_into", "pending_refits", "linger"}
    # Each role's session has its own calls, and only those.
    assert {n for n in used if hasattr(PolicySession, n)} == {"send", "linger", "pending_refits"}
    assert {n for n in used if hasattr(RolloutSession, n)} == {
        "receive_into",
        "pending_refits",
        "linger",
    }
    assert "refit_id" in inspect.signature(PolicySession.send).parameters
    receive_into = inspect.signature(RolloutSession.receive_into).parameters
    assert {"refit_id", "mode"} <= set(receive_into)
    # The README's servers take "the next refit": refit_id defaults to it.
    assert receive_into["refit_id"].default is None
    for cls in (RefitSession, PolicySession, RolloutSession):
        assert hasattr(cls, "from_env") and hasattr(cls, "__enter__")


def test_example_shows_a_server_in_each_receive_mode() -> None:
    tree = ast.parse(_example())
    modes = [
        keyword.value.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "receive_into"
        for keyword in node.keywords
        if keyword.arg == "mode" and isinstance(keyword.value, ast.Constant)
    ]
    assert sorted(modes) == sorted(RECEIVE_MODES)
    for mode in modes:
        check_mode(mode)  # raises for a mode the API does not know
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert "PartialRefitError" in names, "the in-place server must handle a partial refit"
