"""A user's session with the real kubectl v1.35: apply a RefitJob, get its children, wait
on its status, delete it.

Real: kubectl (from :mod:`binaries`, run as a subprocess), kopf and the operator in the
test's event loop, the example manifests.  Emulated: the Kubernetes API server
(``tests/emulator``), and the kubelet (pod phases are written by the test).

One limit of the emulator shapes the commands: it serves no OpenAPI document, so ``apply``
runs with ``--validate=false`` (the CRD's schema is checked elsewhere, see
``tests/unit/test_crd_agreement.py``).  Everything else is what a user types: ``kubectl get
pods,svc,cm -l ...`` and ``kubectl get rj`` resolve through the emulator's discovery.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import yaml
from tests.binaries import REPO_ROOT, ensure_tools
from tests.emulator import ApiEmulator
from tests.integration.support import NS, PODS, OperatorRun, eventually, set_pod_phase

EXAMPLES = REPO_ROOT / "examples"
KUBECTL_TIMEOUT_S = 60.0


def example_jobs() -> list[Path]:
    """Every manifest under ``examples/`` whose documents include a RefitJob."""
    found = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        if any(d.get("kind") == "RefitJob" for d in docs):
            found.append(path)
    return found


class Kubectl:
    """kubectl pointed at the emulator, with its own HOME (discovery cache)."""

    def __init__(self, api: ApiEmulator, home: Path) -> None:
        self.binary = ensure_tools().kubectl
        self.env = {
            **os.environ,
            "KUBECONFIG": str(api.kubeconfig_path),
            "HOME": str(home),
            # client-go's streaming list waits for a bookmark the emulator does not send;
            # the classic list-then-watch is what kubectl falls back to on older servers.
            "KUBE_FEATURE_WatchListClient": "false",
        }

    async def __call__(self, *args: str, check: bool = True) -> tuple[int, str, str]:
        # A subprocess awaited, not run: the emulator and kopf live in this event loop.
        proc = await asyncio.create_subprocess_exec(
            str(self.binary),
            *args,
            env=self.env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), KUBECTL_TIMEOUT_S)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise TimeoutError(f"kubectl {' '.join(args)} ran past {KUBECTL_TIMEOUT_S}s") from None
        code = proc.returncode if proc.returncode is not None else -1
        if check and code != 0:
            raise AssertionError(f"kubectl {' '.join(args)} exited {code}: {err.decode()}")
        return code, out.decode(), err.decode()

    async def json(self, *args: str) -> Any:
        _, out, _ = await self(*args)
        return json.loads(out)


def _job(path: Path) -> dict[str, Any]:
    (job,) = [d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == "RefitJob"]
    return dict(job)


def _in_test_namespace(manifest: Path, workdir: Path) -> Path:
    """The manifest itself, or a copy without ``metadata.namespace`` when it names another
    namespace than the one the embedded operator watches (cluster examples name theirs)."""
    docs = [d for d in yaml.safe_load_all(manifest.read_text()) if d]
    if all(d.get("metadata", {}).get("namespace", NS) == NS for d in docs):
        return manifest
    for doc in docs:
        doc.get("metadata", {}).pop("namespace", None)
    copy = workdir / manifest.name
    copy.write_text(yaml.safe_dump_all(docs))
    return copy


def _replicas(job: dict[str, Any], role: str) -> int:
    return int(job["spec"].get(role, {}).get("replicas", 1))


def _names(items: list[dict[str, Any]], kind: str) -> list[str]:
    return sorted(i["metadata"]["name"] for i in items if i["kind"] == kind)


async def test_apply_get_wait_delete_every_example(
    kube_emulator: ApiEmulator, operator: OperatorRun, tmp_path: Path
) -> None:
    manifests = example_jobs()
    assert manifests, f"{EXAMPLES} holds no RefitJob manifest to apply"
    kubectl = Kubectl(kube_emulator, tmp_path)
    for manifest in manifests:
        await user_session(kubectl, kube_emulator, _in_test_namespace(manifest, tmp_path))


async def user_session(kubectl: Kubectl, kube_emulator: ApiEmulator, manifest: Path) -> None:
    """apply, get the children, wait on the status, delete: as docs/cluster.md shows."""
    job = _job(manifest)
    name = job["metadata"]["name"]
    selector = f"refit.dev/job={name}"

    _, out, _ = await kubectl("apply", "--validate=false", "-n", NS, "-f", str(manifest))
    assert f"refitjob.refit.dev/{name} created" in out

    pods_wanted = sorted(
        f"{name}-{role}-{rank}"
        for role in ("policy", "rollout")
        for rank in range(_replicas(job, role))
    )
    await eventually(
        lambda: len(kube_emulator.list(PODS, NS, f"refit.dev/job={name}")) == len(pods_wanted),
        f"{len(pods_wanted)} pods of {name}",
    )

    children = await kubectl.json("get", "pods,svc,cm", "-n", NS, "-l", selector, "-o", "json")
    items = children["items"]
    assert _names(items, "Pod") == pods_wanted
    assert _names(items, "Service") == [f"{name}-policy", f"{name}-rollout"]
    assert f"{name}-rendezvous" in _names(items, "ConfigMap")
    for child in items:
        (owner,) = child["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["controller"]) == ("RefitJob", name, True)

    jobs = await kubectl.json("get", "rj", "-n", NS, "-o", "json")
    assert [j["metadata"]["name"] for j in jobs["items"]] == [name]

    # What a user watches: the phase, then the Ready condition once the kubelet runs pods.
    await kubectl(
        "wait",
        f"refitjobs/{name}",
        "-n",
        NS,
        "--for=jsonpath={.status.phase}=Pending",
        "--timeout=30s",
    )
    for pod in pods_wanted:
        set_pod_phase(kube_emulator, pod, "Running")
    await kubectl("wait", f"refitjobs/{name}", "-n", NS, "--for=condition=Ready", "--timeout=30s")
    _, phase, _ = await kubectl(
        "get", f"refitjobs/{name}", "-n", NS, "-o", "jsonpath={.status.phase}"
    )
    assert phase == "Running"

    # Deleting the job takes its children with it (ownerReferences, cascading delete).
    await kubectl("delete", "-n", NS, "-f", str(manifest), "--wait", "--timeout=30s")
    await eventually(
        lambda: not kube_emulator.list(PODS, NS, f"refit.dev/job={name}"),
        f"pods of {name} to be deleted with it",
    )
    code, _, err = await kubectl("get", f"refitjobs/{name}", "-n", NS, check=False)
    assert code != 0
    assert "NotFound" in err or "not found" in err
