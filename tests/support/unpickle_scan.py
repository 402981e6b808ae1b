"""The unpickling scanner: every place in the source that can turn bytes into code.

Shared by ``tests/unit/test_security_unpickle_scan.py`` and
``bench/reliability_badinput.py``.  It parses every module under ``worker/``, ``operator/``
and ``examples/`` (the AST, not the text:
a docstring that says "no pickle" is no finding, an aliased import is one) and reports each
place that can turn bytes into code or arbitrary objects:

- importing a code-executing serialiser (pickle, cloudpickle, dill, marshal, shelve, ...);
- NIXL's pickled descriptor helpers ``get_serialized_descs`` / ``deserialize_descs``;
- torch.distributed's object collectives (they pickle under the hood);
- ``torch.load`` without ``weights_only=True``, ``numpy.load(allow_pickle=True)``;
- ``yaml.load`` without a safe loader, ``yaml.unsafe_load`` / ``yaml.full_load`` (a
  loader class of the same module that derives from a safe one and is given no
  constructor counts as safe: it can only resolve scalars differently);
- the builtins ``eval`` / ``exec`` / ``compile``.

"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = (ROOT / "worker", ROOT / "operator", ROOT / "examples")

BANNED_MODULES = frozenset(
    {
        "pickle",
        "_pickle",
        "cPickle",
        "cloudpickle",
        "dill",
        "marshal",
        "shelve",
        "jsonpickle",
        "joblib",
    }
)
#: Method names that (de)serialise with pickle whatever object they are called on.
BANNED_METHODS = frozenset(
    {
        "get_serialized_descs",
        "deserialize_descs",
        "all_gather_object",
        "gather_object",
        "broadcast_object_list",
        "scatter_object_list",
        "send_object_list",
        "recv_object_list",
    }
)
BANNED_BUILTINS = frozenset({"eval", "exec", "compile", "__import__"})
UNSAFE_YAML = frozenset(
    {"yaml.unsafe_load", "yaml.unsafe_load_all", "yaml.full_load", "yaml.full_load_all"}
)
SAFE_LOADERS = frozenset({"yaml.SafeLoader", "yaml.CSafeLoader", "yaml.BaseLoader"})
#: What gives a loader class the power to build objects from tags.
YAML_CONSTRUCTORS = frozenset({"add_constructor", "add_multi_constructor"})


@dataclass(frozen=True, order=True)
class Finding:
    path: str
    line: int
    what: str


class _Scanner(ast.NodeVisitor):
    """Collects findings for one module; resolves import aliases to dotted names."""

    def __init__(self, path: str, local_loaders: frozenset[str] = frozenset()) -> None:
        self.path = path
        self.aliases: dict[str, str] = {}
        self.findings: list[Finding] = []
        #: This module's safe loader subclasses (see :func:`_local_safe_loaders`).
        self.local_loaders = local_loaders

    def _flag(self, node: ast.AST, what: str) -> None:
        self.findings.append(Finding(self.path, getattr(node, "lineno", 0), what))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] in BANNED_MODULES:
                self._flag(node, f"imports {alias.name}")
            local = alias.asname or alias.name.split(".")[0]
            self.aliases[local] = alias.name if alias.asname else local

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if module.split(".")[0] in BANNED_MODULES:
            self._flag(node, f"imports from {module}")
        for alias in node.names:
            self.aliases[alias.asname or alias.name] = f"{module}.{alias.name}"
            if alias.name in BANNED_METHODS:
                self._flag(node, f"imports {alias.name} from {module}")

    def _dotted(self, node: ast.expr) -> str | None:
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id, node.id)
        if isinstance(node, ast.Attribute):
            base = self._dotted(node.value)
            return None if base is None else f"{base}.{node.attr}"
        return None

    def visit_Call(self, node: ast.Call) -> None:
        name = self._dotted(node.func) or ""
        keywords = {k.arg: k.value for k in node.keywords if k.arg}
        if (
            isinstance(node.func, ast.Name)
            and node.func.id in BANNED_BUILTINS
            and (node.func.id not in self.aliases)
        ):
            self._flag(node, f"calls {node.func.id}()")
        if isinstance(node.func, ast.Attribute) and node.func.attr in BANNED_METHODS:
            self._flag(node, f"calls .{node.func.attr}()")
        if name in ("torch.load", "torch.serialization.load") and not _is_true(
            keywords.get("weights_only")
        ):
            self._flag(node, f"calls {name}() without weights_only=True")
        if name in ("numpy.load", "np.load") and _is_true(keywords.get("allow_pickle")):
            self._flag(node, f"calls {name}(allow_pickle=True)")
        if name in UNSAFE_YAML:
            self._flag(node, f"calls {name}()")
        if name in ("yaml.load", "yaml.load_all"):
            loader = keywords.get("Loader") or (node.args[1] if len(node.args) > 1 else None)
            safe = SAFE_LOADERS | self.local_loaders
            if loader is None or self._dotted(loader) not in safe:
                self._flag(node, f"calls {name}() without a safe Loader")
        self.generic_visit(node)


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _local_safe_loaders(tree: ast.Module) -> frozenset[str]:
    """Classes of this module that derive from a safe loader (named as ``yaml.X`` or ``X``
    imported from yaml) and are never handed a constructor anywhere in the module."""
    aliases = _Scanner("")
    aliases.visit(tree)  # only for its import aliases; its findings are not these
    derived = {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        and any(aliases._dotted(base) in SAFE_LOADERS for base in node.bases)
    }
    given = {
        name.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in YAML_CONSTRUCTORS
        for name in ast.walk(node)
        if isinstance(name, ast.Name)
    }
    return frozenset(derived - given)


def scan_source(text: str, path: str) -> list[Finding]:
    """Findings in one module's source text."""
    tree = ast.parse(text, filename=path)
    scanner = _Scanner(path, _local_safe_loaders(tree))
    scanner.visit(tree)
    return sorted(scanner.findings)


def scan_tree(*roots: Path) -> tuple[int, list[Finding]]:
    """(modules scanned, findings) over every ``*.py`` file below ``roots``."""
    files = sorted(p for root in roots for p in root.rglob("*.py") if "__pycache__" not in p.parts)
    findings = [f for p in files for f in scan_source(p.read_text(), str(p.relative_to(ROOT)))]
    return len(files), findings
