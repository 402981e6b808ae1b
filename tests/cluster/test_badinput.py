"""The bad-manifest corpus of ``tests/support/bad_manifests.py`` sent to the real
apiserver: every spec the models refuse, the CRD (schema + CEL rules) refuses too, with an
HTTP 422 naming the field.  Requests go as ``kubectl`` sends them (``fieldValidation=Strict``,
so an unknown field is an error rather than silently pruned) and as dry runs, so nothing is
stored either way.

The corpus's whole-file rows (``BAD_FILES``: not YAML, no RefitJob, two RefitJobs, the old
apiVersion, the name checks) are about what ``refit run`` reads from a file; they do not
reach an apiserver as a RefitJob and are not sent.

Real: kube-apiserver with the CRD from ``crds/refitjob.yaml``.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml
from tests.binaries import REPO_ROOT
from tests.cluster.rest import ApiError
from tests.cluster.support import Cluster, wait, wait_established
from tests.support.bad_manifests import BAD_SPECS, BASE, ISSUE_50_FILES, NOT_IN_YAML

from refit_operator.api.models import API_VERSION

NS = "badinput"
JOBS = f"/apis/{API_VERSION}/namespaces/{NS}/refitjobs"
#: The first dotted field path a row's expected words name (``spec.policy.env[0].name``).
_FIELD = re.compile(r"spec(?:\.[A-Za-z]+(?:\[\d+\])?)+")


@pytest.fixture(scope="module")
def crd(cluster: Cluster) -> Cluster:
    cluster.kubectl.ok("apply", "--server-side", "-f", str(REPO_ROOT / "crds" / "refitjob.yaml"))
    wait_established(cluster)
    cluster.namespace(NS)
    return cluster


def _create(cluster: Cluster, spec: Any) -> Any:
    job = {"apiVersion": API_VERSION, "kind": "RefitJob", "metadata": {"name": "bad"}, "spec": spec}
    return cluster.rest.request(
        "POST", JOBS, job, params={"dryRun": "All", "fieldValidation": "Strict"}
    )


def field_named(words: tuple[str, ...]) -> str:
    """Where the row's message points: its first ``spec.…`` path, else ``spec``."""
    for word in words:
        found = _FIELD.search(word)
        if found:
            return found.group(0)
    return "spec"


def names_field(message: str, field: str) -> bool:
    """The apiserver names ``field``: by its path, by its path inside ``spec`` (a CEL
    rule on the spec says ``policy.replicas``), or by the object that holds it (a rule on
    an env entry says ``spec.policy.env[0]``)."""
    parent = field.rsplit(".", 1)[0]
    inside = field.removeprefix("spec.")
    return any(name in message for name in (field, inside)) or (
        parent != "spec" and f"{parent}:" in message
    )


def _json_can_carry(spec: Any) -> bool:
    try:
        json.dumps(spec, allow_nan=False)
    except ValueError:
        return False
    return True


def test_the_base_spec_is_accepted(crd: Cluster) -> None:
    created = wait(lambda: _create(crd, BASE), "the CRD's API to serve RefitJobs", timeout=30)
    assert created["spec"]["image"] == BASE["image"]


@pytest.mark.parametrize("size", [1048576, "1048576", "1Mi"])
def test_a_bucket_size_as_the_docs_write_it_is_accepted(crd: Cluster, size: int | str) -> None:
    """docs/cluster.md: quantities may be integers; the apiserver stores what was sent."""
    spec = {**BASE, "transfer": {"bucketSize": size}}
    created = wait(lambda: _create(crd, spec), "the CRD's API to serve RefitJobs", timeout=30)
    assert created["spec"]["transfer"]["bucketSize"] == size


@pytest.mark.parametrize(
    ("spec", "words"), [r[1:] for r in BAD_SPECS], ids=[r[0] for r in BAD_SPECS]
)
def test_the_crd_refuses_what_the_models_refuse(
    crd: Cluster, spec: Any, words: tuple[str, ...]
) -> None:
    if not _json_can_carry(spec):
        # NaN and infinities have no JSON form: no client sends them to an apiserver;
        # kubectl refuses the YAML itself.
        doc = {
            "apiVersion": API_VERSION,
            "kind": "RefitJob",
            "metadata": {"name": "bad"},
            "spec": spec,
        }
        done = crd.kubectl.run("apply", "-n", NS, "-f", "-", stdin=yaml.safe_dump(doc))
        assert done.returncode != 0 and "unsupported value" in done.stderr, done.stderr
        return
    with pytest.raises(ApiError) as info:
        _create(crd, spec)
    error = info.value
    # 422 Invalid; 400 for an unknown field under fieldValidation=Strict.
    assert error.status == 422 or (error.status == 400 and "unknown field" in error.message), error
    field = field_named(words)
    assert names_field(error.message, field), f"the apiserver did not name {field}: {error.message}"


def test_kubectl_apply_of_a_bad_manifest_names_the_field(crd: Cluster) -> None:
    _, spec, _words = next(r for r in BAD_SPECS if r[0] == "policy replicas 0")
    doc = {
        "apiVersion": API_VERSION,
        "kind": "RefitJob",
        "metadata": {"name": "bad", "namespace": NS},
        "spec": spec,
    }
    done = crd.kubectl.run("apply", "-f", "-", stdin=yaml.safe_dump(doc))
    assert done.returncode != 0
    assert "spec.policy.replicas" in done.stderr, done.stderr
    assert crd.rest.find(f"{JOBS}/bad") is None


@pytest.mark.parametrize(
    ("text", "words"), [r[1:] for r in ISSUE_50_FILES], ids=[r[0] for r in ISSUE_50_FILES]
)
def test_kubectl_apply_of_issue_50_inputs_as_written_names_the_field(
    crd: Cluster, text: str, words: tuple[str, ...]
) -> None:
    """``timeoutSeconds: 1e308``, ``layers: 1e12`` as a user types them: kubectl sends
    numbers (``refit run`` reads them the same way), and the CRD refuses them by bound."""
    done = crd.kubectl.run("apply", "--dry-run=server", "-n", NS, "-f", "-", stdin=text)
    assert done.returncode != 0, done.stdout
    field = field_named(words)
    assert names_field(done.stderr, field), f"kubectl did not name {field}: {done.stderr}"


@pytest.mark.parametrize("row", sorted(NOT_IN_YAML))
def test_kubectl_sends_a_whole_float_as_an_integer(crd: Cluster, row: str) -> None:
    """Why ``NOT_IN_YAML``'s rows are valid in a file: ``replicas: 2.0`` reaches the
    apiserver as 2, as ``refit run``'s loader reads it."""
    spec = next(r[1] for r in BAD_SPECS if r[0] == row)
    doc = {"apiVersion": API_VERSION, "kind": "RefitJob", "metadata": {"name": "ok"}, "spec": spec}
    done = crd.kubectl.run(
        "apply", "--dry-run=server", "-n", NS, "-o", "json", "-f", "-", stdin=yaml.safe_dump(doc)
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["spec"]["policy"]["replicas"] == 2
