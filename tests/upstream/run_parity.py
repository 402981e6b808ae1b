"""Run upstream's own tests of the signal handler against ``refit_worker.signals.handler``.

NVIDIA-NeMo/Automodel tests its handler in
``tests/unit_tests/components/training/test_signal_handler.py``, which imports
``nemo_automodel.components.training.signal_handler``.  This script makes that name (and its
parent packages, as empty modules) point at ``refit_worker.signals.handler`` and runs pytest
on the file given, so the drop-in claim is checked by upstream's tests, not by ours.

The upstream file is not part of this project: fetch it from the upstream repository and
pass its path::

    python tests/upstream/run_parity.py /tmp/upstream/test_signal_handler.py

Exit status: pytest's.  Not collected by pytest (the name does not start with ``test_``).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

#: The module upstream's tests import, and what stands in for it.
UPSTREAM = "nemo_automodel.components.training.signal_handler"
OURS = "refit_worker.signals.handler"


def install_alias(upstream: str = UPSTREAM, ours: str = OURS) -> types.ModuleType:
    """Make ``import <upstream>`` give the module ``ours``; returns that module.

    Parent packages that do not exist are created empty; none that exists is replaced.
    """
    import importlib

    module = importlib.import_module(ours)
    parts = upstream.split(".")
    parent: types.ModuleType | None = None
    for depth in range(1, len(parts)):
        name = ".".join(parts[:depth])
        package = sys.modules.get(name)
        if package is None:
            package = types.ModuleType(name, f"stand-in package for {upstream}")
            package.__path__ = []  # a package: its submodules resolve through sys.modules
            sys.modules[name] = package
        if parent is not None:
            setattr(parent, parts[depth - 1], package)
        parent = package
    sys.modules[upstream] = module
    if parent is not None:
        setattr(parent, parts[-1], module)
    return module


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_file():
        print(__doc__, file=sys.stderr)
        print(f"error: need the path of upstream's test file, got {argv}", file=sys.stderr)
        return 2
    root = Path(__file__).resolve().parents[2]
    sys.path[:0] = [str(root / "worker")]
    install_alias()
    import pytest

    # Upstream's file on its own: no plugin cache written beside it, none of our conftests.
    target = Path(argv[0])
    args = [str(target), "-q", "-p", "no:cacheprovider", "--rootdir", str(target.parent)]
    return int(pytest.main(args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
