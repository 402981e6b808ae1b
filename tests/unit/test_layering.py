"""The layering holds, and its checks can fail.

- ``lint-imports`` (import-linter, contracts in ``pyproject.toml``) is run on a copy of the
  source with one violation planted per case, and must refuse it naming the contract; the
  clean copy passes, so the refusal is the planted line's doing.  The operator's cases
  cover each of its folder contracts, a new module at its top level included.
- ``refit_worker.contract`` imports only the standard library and pydantic (an AST scan of
  each module, and a fresh interpreter that loads them all); its stdlib-only modules load
  without pydantic (``refit-signal`` runs them as a preStop hook).
- No test module imports another test module (shared code lives in ``tests/support``).

Real: import-linter run as a subprocess on files on disk, fresh interpreters.  Nothing is
emulated.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = ROOT / "worker" / "refit_worker" / "contract"
LINT = (
    "import sys; from importlinter.cli import lint_imports_command;"
    " sys.exit(lint_imports_command())"
)
#: The operator's folders as layers (``pyproject.toml``), as lint-imports names it refused.
LAYERS = "The operator's layers: cli, shell | local, apply, core, render, api BROKEN"


def _copy_tree(dest: Path) -> Path:
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for part in ("operator", "worker"):
        shutil.copytree(ROOT / part, dest / part, ignore=skip)
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    # The copy's source roots first on the path, so the copy is what grimp analyses.
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{tree / 'operator'}:{tree / 'worker'}"}
    return subprocess.run(
        [sys.executable, "-c", LINT, "--no-cache"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


@pytest.mark.parametrize(
    ("module", "planted", "contract"),
    [
        (
            "worker/refit_worker/pod/weights.py",
            "import refit_operator.api.models",
            "The worker never imports the operator BROKEN",
        ),
        (
            "operator/refit_operator/render/pods.py",
            "import refit_worker.session",
            "The operator imports only refit_worker.contract of the worker BROKEN",
        ),
        (
            "operator/refit_operator/core/steps/failure_policy.py",
            "import aiohttp",
            "api, render, core, apply and local import no kopf, kubernetes nor aiohttp BROKEN",
        ),
        (
            "operator/refit_operator/render/pods.py",
            "from refit_operator.core import decision",
            LAYERS,
        ),
        (
            "operator/refit_operator/local/runner.py",
            "import refit_operator.shell.kube",
            LAYERS,
        ),
        (
            "operator/refit_operator/stray.py",
            "import refit_operator.api.names",
            LAYERS,
        ),
        (
            "operator/refit_operator/shell/controller.py",
            "import kopf",
            "In shell, only handlers, runtime and settings import kopf BROKEN",
        ),
        (
            "operator/refit_operator/local/preflight.py",
            "import torch",
            "The operator imports neither torch nor nixl BROKEN",
        ),
        (
            "operator/refit_operator/shell/lease.py",
            "import kubernetes",
            "The shell's lease, events and metrics import no kubernetes nor aiohttp BROKEN",
        ),
        (
            "worker/refit_worker/engine/planning/buckets.py",
            "from refit_worker.pod import weights",
            "The engine imports no other worker module but the contract BROKEN",
        ),
        (
            "worker/refit_worker/rollout/targets.py",
            "from refit_worker.engine.rollout import refit_receive as refit",
            "Outside the engine, the worker imports only the engine's face BROKEN",
        ),
        (
            "worker/refit_worker/engine/planning/mapping.py",
            "from refit_worker.engine.policy import routes",
            "The engine's folders are layered: roles over transport over plans BROKEN",
        ),
        (
            "worker/refit_worker/engine/rollout/staging.py",
            "import nixl",
            "In the engine, only the transport imports nixl BROKEN",
        ),
        (
            "worker/refit_worker/engine/planning/layout.py",
            "import torch",
            "The engine's pure modules import neither torch nor nixl BROKEN",
        ),
        (
            "worker/refit_worker/contract/roles.py",
            "import torch",
            "The contract imports nothing else of the project, nor heavy packages BROKEN",
        ),
        (
            "worker/refit_worker/rollout/targets.py",
            "import refit_worker.policy.owed",
            "The worker's rooms are layered: roles over session over engine BROKEN",
        ),
        (
            "worker/refit_worker/session/refits.py",
            "import refit_worker.rollout.targets",
            "The worker's rooms are layered: roles over session over engine BROKEN",
        ),
        (
            "worker/refit_worker/signals/pid_registry.py",
            "import nixl",
            "The signals import neither nixl, kubernetes nor pydantic BROKEN",
        ),
        (
            "worker/refit_worker/integrations/vllm/served_modules.py",
            "import vllm",
            "Only the vLLM integration imports vLLM, not its pure readers BROKEN",
        ),
    ],
    ids=[
        "worker->operator",
        "operator->worker",
        "pure->aiohttp",
        "render->core",
        "local->shell",
        "top-level-module",
        "controller->kopf",
        "operator->torch",
        "lease->kubernetes",
        "engine->worker",
        "past the engine's face",
        "engine plans->roles",
        "engine roles->nixl",
        "engine pure->torch",
        "contract",
        "rollout->policy",
        "session->rollout",
        "signals->nixl",
        "reader->vllm",
    ],
)
def test_lint_imports_refuses_a_planted_violation(
    tmp_path: Path, module: str, planted: str, contract: str
) -> None:
    tree = _copy_tree(tmp_path)
    clean = _lint(tree)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    target = tree / module
    before = target.read_text() if target.exists() else ""  # or a new module, planted whole
    target.write_text(before + f"\n{planted}  # planted by the test\n")
    broken = _lint(tree)
    assert broken.returncode != 0
    assert contract in broken.stdout, broken.stdout + broken.stderr


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    found |= {
        n.module
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module and not n.level
    }
    return found


@pytest.mark.parametrize("path", sorted(CONTRACT.glob("*.py")), ids=lambda p: p.name)
def test_the_contract_imports_only_the_standard_library_and_pydantic(path: Path) -> None:
    for name in _imports(path) - {"__future__"}:
        top = name.split(".")[0]
        if top == "refit_worker":
            assert name.startswith("refit_worker.contract."), f"{path.name} imports {name}"
        else:
            assert top in sys.stdlib_module_names or top == "pydantic", f"{path.name}: {name}"


def _loaded_after(imports: str) -> set[str]:
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        f"{imports}\n"
        "print(' '.join(sorted({m.split('.')[0] for m in set(sys.modules) - before})))\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "worker")}
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    # Private names are the interpreter's own (_sysconfigdata_..., _distutils_hack).
    return {m for m in done.stdout.split() if m not in sys.stdlib_module_names and m[0] != "_"}


def test_the_whole_contract_loads_with_pydantic_alone() -> None:
    stems = sorted(p.stem for p in CONTRACT.glob("*.py") if p.stem != "__init__")
    loaded = _loaded_after("import " + ", ".join(f"refit_worker.contract.{s}" for s in stems))
    assert loaded <= {
        "refit_worker",
        "pydantic",
        "pydantic_core",
        "typing_extensions",
        "annotated_types",
        "typing_inspection",
    }, loaded


def test_the_stdlib_parts_of_the_contract_load_without_pydantic() -> None:
    parts = ("signals", "env", "exits", "roles", "dtypes")
    loaded = _loaded_after("import " + ", ".join(f"refit_worker.contract.{p}" for p in parts))
    assert loaded == {"refit_worker"}, loaded


def test_no_test_module_imports_another() -> None:
    offenders = []
    for path in sorted([*(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").rglob("*.py")]):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                names = [base, *(f"{base}.{a.name}" for a in node.names)]
            if any(n.rsplit(".", 1)[-1].startswith("test_") for n in names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == [], "test modules imported as libraries: " + ", ".join(offenders)


def test_pure_modules_import_neither_kopf_nor_kubernetes() -> None:
    """Loading the pure core, the renderers and the CLI pulls in no kopf nor kubernetes."""
    code = (
        "import sys\n"
        "import refit_operator.api.models, refit_operator.api.crd, refit_operator.api.names\n"
        "import refit_operator.render.pods, refit_operator.api.quantity\n"
        "import refit_operator.apply.applier, refit_operator.core.reconcile\n"
        "import refit_operator.local.runner\n"
        "import refit_operator.cli\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('kopf', 'kubernetes'))\n"
        "print(','.join(bad))\n"
    )
    env = {"PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'worker'}", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


#: Test tiers by folder; what they share lives in ``tests/support`` (and the emulator).
TIERS = frozenset({"unit", "integration", "e2e", "reliability", "cluster", "gpu"})


def _tier_imports(path: Path) -> set[str]:
    """The tiers ``path`` imports modules of (``tests.<tier>.…``)."""
    return {
        name.split(".")[1]
        for name in _imports(path)
        if name.startswith("tests.") and name.split(".")[1] in TIERS
    }


def test_no_tier_and_no_bench_imports_another_tiers_modules() -> None:
    files = [*(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").rglob("*.py")]
    crossing = []
    for path in files:
        parts = path.relative_to(ROOT).parts
        own = parts[1] if parts[0] == "tests" and len(parts) > 2 else None
        crossing += [
            f"{path.relative_to(ROOT)} imports tests.{tier}" for tier in _tier_imports(path) - {own}
        ]
    assert crossing == [], crossing


def test_the_tier_scan_sees_a_crossing(tmp_path: Path) -> None:
    planted = tmp_path / "bench_like.py"
    planted.write_text("from tests.integration.support import load_job\nimport tests.support.x\n")
    assert _tier_imports(planted) == {"integration"}


def test_a_worker_that_holds_no_dtensor_never_loads_dtensor_or_sympy() -> None:
    # ~1 s of CPU at every worker's start (torch.distributed.tensor pulls in sympy): only a
    # trainer that made DTensors has the module loaded, and only then is it asked for.
    code = (
        "import sys\n"
        "import refit_worker.__main__, refit_worker.policy.policy_session\n"
        "import refit_worker.rollout.rollout_session\n"
        "import refit_worker.integrations.staged\n"
        "print(sorted(m for m in ('torch.distributed.tensor', 'sympy') if m in sys.modules))\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "worker")}
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
