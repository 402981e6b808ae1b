"""Nothing that reaches the network or another process's files is unpickled (pure, AST scan).

The scanner (``tests/support/unpickle_scan.py``) parses every module under ``worker/``,
``operator/`` and ``examples/`` and reports each place that can turn bytes into code or
arbitrary objects.  Two tests prove the scanner can fail: a planted module with one
instance of each is reported line by line, and a module of look-alikes that are safe is not.

Real: the project's source files.  Nothing emulated.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.support.unpickle_scan import SCANNED, Finding, scan_source, scan_tree

PLANTED = """\
import pickle
import cloudpickle as cp
from dill import loads
import marshal
import torch
import torch as th
import yaml
from yaml import load as yload
import numpy as np
from torch.distributed import all_gather_object

def bad(agent, blob, group):
    pickle.loads(blob)
    descs = agent.deserialize_descs(blob)
    agent.get_serialized_descs(descs)
    torch.load(blob)
    th.load(blob, weights_only=False)
    yaml.load(blob)
    yload(blob, Loader=yaml.Loader)
    yaml.unsafe_load(blob)
    np.load(blob, allow_pickle=True)
    eval(blob)
    exec(blob)
    torch.distributed.broadcast_object_list([blob], group=group)

class Rich(yaml.SafeLoader):
    pass  # derived from a safe loader, then taught to build objects below: not safe

Rich.add_constructor("!obj", lambda loader, node: object())

def worse(blob):
    return yaml.load(blob, Loader=Rich)
"""

PLANTED_WANT = [
    (1, "imports pickle"),
    (2, "imports cloudpickle"),
    (3, "imports from dill"),
    (4, "imports marshal"),
    (10, "imports all_gather_object from torch.distributed"),
    (14, "calls .deserialize_descs()"),
    (15, "calls .get_serialized_descs()"),
    (16, "calls torch.load() without weights_only=True"),
    (17, "calls torch.load() without weights_only=True"),
    (18, "calls yaml.load() without a safe Loader"),
    (19, "calls yaml.load() without a safe Loader"),
    (20, "calls yaml.unsafe_load()"),
    (21, "calls numpy.load(allow_pickle=True)"),
    (22, "calls eval()"),
    (23, "calls exec()"),
    (24, "calls .broadcast_object_list()"),
    (32, "calls yaml.load() without a safe Loader"),
]

LOOK_ALIKES = '''\
"""This module never uses pickle, eval or yaml.load; it says so in words only."""
import json
import torch
import yaml
from yaml import SafeLoader

def fine(model, text, path):
    model.eval()
    torch.load(path, weights_only=True)
    yaml.safe_load(text)
    yaml.load(text, Loader=yaml.SafeLoader)
    yaml.load(text, SafeLoader)
    json.loads(text)
    return "pickle.loads(x) eval(x)"

class Floats(SafeLoader):
    """A safe loader that reads one more float syntax, and builds nothing new."""

Floats.add_implicit_resolver("tag:yaml.org,2002:float", FLOAT, list("0123456789"))

def also_fine(text):
    return list(yaml.load_all(text, Loader=Floats))
'''


def test_scanner_reports_each_planted_hazard_by_line() -> None:
    found = [(f.line, f.what) for f in scan_source(PLANTED, "planted.py")]
    assert found == PLANTED_WANT


def test_scanner_ignores_safe_look_alikes() -> None:
    assert scan_source(LOOK_ALIKES, "fine.py") == []


def test_scanner_finds_a_planted_file_inside_the_tree(tmp_path: Path) -> None:
    package = tmp_path / "pkg" / "sub"
    package.mkdir(parents=True)
    (package / "clean.py").write_text(LOOK_ALIKES)
    (package / "wire.py").write_text("import pickle\n\ndef read(b):\n    return pickle.loads(b)\n")
    files = sorted(p for p in tmp_path.rglob("*.py"))
    findings = [f for p in files for f in scan_source(p.read_text(), p.name)]
    assert findings == [Finding("wire.py", 1, "imports pickle")]


@pytest.mark.parametrize("root", SCANNED, ids=lambda p: p.name)
def test_project_source_unpickles_nothing(root: Path) -> None:
    count, findings = scan_tree(root)
    least = 1 if root.name == "examples" else 10
    assert count >= least, f"scanned only {count} modules under {root}: wrong root?"
    assert findings == [], "\n".join(f"{f.path}:{f.line}: {f.what}" for f in findings)
