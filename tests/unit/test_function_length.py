"""No function in the operator or the worker is longer than 60 lines (the project's rule
for ``operator/refit_operator`` and ``worker/refit_worker``): an AST walk of every module,
nested functions included.

Real: the source files on disk.  Nothing is emulated.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OPERATOR = ROOT / "operator" / "refit_operator"
WORKER = ROOT / "worker" / "refit_worker"
MAX_LINES = 60


def long_functions(source: str, max_lines: int = MAX_LINES) -> list[tuple[str, int]]:
    """(name, lines) of each function of ``source`` longer than ``max_lines``, decorators
    included (a kopf handler's decorators are part of what a reader goes through)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            lines = (node.end_lineno or node.lineno) - first + 1
            if lines > max_lines:
                found.append((node.name, lines))
    return found


@pytest.mark.parametrize("package", [OPERATOR, WORKER], ids=["operator", "worker"])
def test_no_function_is_over_60_lines(package: Path) -> None:
    modules = sorted(package.rglob("*.py"))
    assert len(modules) > 40  # the walk sees the package, not an empty directory
    over = [
        f"{path.relative_to(ROOT)}: {name} ({lines} lines)"
        for path in modules
        for name, lines in long_functions(path.read_text())
    ]
    assert over == [], "functions over 60 lines:\n" + "\n".join(over)


def test_the_check_finds_a_long_function() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    source = f"def short():\n    pass\n\n@decorated\nasync def long():\n{body}\n"
    assert long_functions(source) == [("long", MAX_LINES + 2)]
    assert long_functions(source, max_lines=MAX_LINES + 2) == []
