"""The operator's Events on a real apiserver: ``events.k8s.io/v1`` (the cluster serves it),
a repeat updates the first Event's series instead of adding one, a different message is a
new Event, and ``kubectl`` shows them on the RefitJob (core/v1 reads the same objects).

Real: kube-apiserver, its Event validation, kubectl; the operator's own API client
(``refit_operator.shell.kube``) driven from the test, with the admin's kubeconfig.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from tests.binaries import REPO_ROOT
from tests.cluster.support import Cluster, example

from refit_operator.shell import kube

NS = "events"
CRD = REPO_ROOT / "crds" / "refitjob.yaml"


def _post_three(kubeconfig: str, job: dict[str, Any]) -> None:
    """Post one Event twice and another once, with the operator's client."""

    async def post() -> None:
        os.environ["KUBECONFIG"] = kubeconfig
        api = kube.Kube.connect()
        try:
            for message in ("gang preempted (1): node drained", "gang preempted (1): node drained"):
                await api.post_event(job, "Warning", "Preempted", message)
            await api.post_event(job, "Warning", "Preempted", "gang preempted (2): evicted")
        finally:
            await api.close()

    asyncio.run(post())


def test_a_repeat_joins_the_series_and_kubectl_shows_it(cluster: Cluster) -> None:
    cluster.namespace(NS)
    cluster.kubectl.ok("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    cluster.kubectl.ok("wait", "--for=condition=Established", "crd/refitjobs.refit.dev")
    job = example("local", metadata={"name": "noisy", "namespace": NS})
    job["spec"]["suspend"] = True
    cluster.kubectl.apply(job)
    job = cluster.kubectl.json("get", "rj", "noisy", "-n", NS)
    _post_three(str(cluster.plane.kubeconfig_path), job)
    items = cluster.rest.get(f"/apis/events.k8s.io/v1/namespaces/{NS}/events")["items"]
    ours = [e for e in items if e["regarding"]["uid"] == job["metadata"]["uid"]]
    by_note = {e["note"]: e for e in ours}
    assert len(ours) == 2, ours
    repeated = by_note["gang preempted (1): node drained"]
    # Posted through events.k8s.io/v1: an eventTime and a series (core/v1 has neither).
    assert repeated["series"]["count"] == 2 and repeated["eventTime"]
    assert repeated["reportingController"] == "refit.dev/refit-operator"
    assert (repeated["type"], repeated["reason"], repeated["action"]) == (
        "Warning",
        "Preempted",
        "Reconcile",
    )
    assert "series" not in by_note["gang preempted (2): evicted"]
    described = cluster.kubectl.ok("describe", "rj", "noisy", "-n", NS)
    assert "gang preempted (1): node drained" in described
    assert "gang preempted (2): evicted" in described
    cluster.kubectl.ok("delete", "rj", "noisy", "-n", NS, "--wait=true", "--timeout=60s")
