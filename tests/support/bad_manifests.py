"""The bad-input corpus: bad RefitJob manifests, one per row, with the words the message
that refuses each must contain (which field, which value).

``tests/unit/test_badinput_manifests.py`` sends every spec row three ways (the operator's
:func:`parse_spec`, ``refit run``'s loader, the generated CRD judged offline);
``bench/reliability_badinput.py`` reports on the same rows; other tiers (a real API server)
may apply them too.  Manifest rows (YAML, kind, apiVersion, name) concern the loader only.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from refit_operator.api.models import API_VERSION

BASE: dict[str, Any] = {"image": "img:1", "policy": {"replicas": 1}, "rollout": {"replicas": 1}}
_DROP = object()


def changed(path: str, value: Any) -> dict[str, Any]:
    """BASE with ``value`` at the dotted ``path`` (``_DROP`` removes the key)."""
    spec = copy.deepcopy(BASE)
    *parents, last = path.split(".")
    here = spec
    for step in parents:
        here = here.setdefault(step, {})
    if value is _DROP:
        here.pop(last, None)
    else:
        here[last] = value
    return spec


#: A pod template's spec with only the worker container.
WORKER_ONLY: dict[str, Any] = {"containers": [{"name": "worker"}]}


def template(role: str, container: dict[str, Any] | None = None, **pod_spec: Any) -> dict[str, Any]:
    """BASE with a pod template for ``role``: the worker container (with ``container``'s
    fields) and ``pod_spec``'s fields."""
    spec = {"containers": [{"name": "worker", **(container or {})}], **pod_spec}
    return changed(f"{role}.template", {"spec": spec})


#: (id, spec, the words the message must contain: where, and what or which value)
BAD_SPECS: list[tuple[str, Any, tuple[str, ...]]] = [
    ("image missing", changed("image", _DROP), ("spec.image: Field required",)),
    ("image empty", changed("image", ""), ("spec.image", "at least 1 character")),
    ("image not a string", changed("image", 5), ("spec.image", "valid string (got 5)")),
    (
        "pull policy unknown",
        changed("imagePullPolicy", "Sometimes"),
        ("spec.imagePullPolicy", "'Always', 'IfNotPresent' or 'Never' (got 'Sometimes')"),
    ),
    (
        "policy replicas 0",
        changed("policy.replicas", 0),
        ("spec.policy.replicas", "greater than or equal to 1 (got 0)"),
    ),
    (
        "rollout replicas negative",
        changed("rollout.replicas", -1),
        ("spec.rollout.replicas", "(got -1)"),
    ),
    (
        "replicas over 4096",
        changed("policy.replicas", 4097),
        ("spec.policy.replicas", "less than or equal to 4096 (got 4097)"),
    ),
    (
        "replicas as a string",
        changed("policy.replicas", "2"),
        ("spec.policy.replicas", "valid integer (got '2')"),
    ),
    (
        "replicas as a float",
        changed("policy.replicas", 2.0),
        ("spec.policy.replicas", "valid integer (got 2.0)"),
    ),
    (
        "replicas as a bool",
        changed("policy.replicas", True),
        ("spec.policy.replicas", "valid integer (got True)"),
    ),
    (
        "ranks over one rendezvous",
        {**BASE, "policy": {"replicas": 3000}, "rollout": {"replicas": 2000}},
        ("policy.replicas + rollout.replicas = 5000 is over 4096",),
    ),
    (
        "typo in a role field",
        changed("policy.replicaz", 2),
        ("spec.policy.replicaz", "Extra inputs are not permitted"),
    ),
    (
        "unknown top-level field",
        changed("colour", "blue"),
        ("spec.colour", "Extra inputs are not permitted (got 'blue')"),
    ),
    (
        "python name for a wire field",
        changed("transfer.bucket_size", "1Mi"),
        ("spec.transfer.bucket_size", "Extra inputs are not permitted"),
    ),
    (
        "reserved env name",
        changed("policy.env", [{"name": "REFIT_RANK", "value": "3"}]),
        ("spec.policy.env[0].name", "'REFIT_RANK' is reserved"),
    ),
    (
        "env name with a digit first",
        changed("rollout.env", [{"name": "1X"}]),
        ("spec.rollout.env[0].name", "must be a C identifier", "(got '1X')"),
    ),
    (
        "env without a name",
        changed("policy.env", [{"value": "v"}]),
        ("spec.policy.env[0].name: Field required",),
    ),
    (
        "env value a number",
        changed("policy.env", [{"name": "X", "value": 3}]),
        ("spec.policy.env[0].value", "valid string (got 3)"),
    ),
    ("env as a map", changed("policy.env", {"X": "1"}), ("spec.policy.env", "valid list")),
    (
        "command as a string",
        changed("policy.command", "refit-worker"),
        ("spec.policy.command", "valid list (got 'refit-worker')"),
    ),
    (
        "args with a number",
        changed("rollout.args", ["--x", 1]),
        ("spec.rollout.args[1]", "valid string (got 1)"),
    ),
    (
        "resource request a fraction as a number",
        changed("policy.resources", {"requests": {"cpu": 0.5}}),
        ("spec.policy.resources.requests.cpu", "must be a Kubernetes quantity", "(got 0.5)"),
    ),
    (
        "resource limit negative",
        changed("policy.resources", {"limits": {"nvidia.com/gpu": -1}}),
        ("spec.policy.resources.limits.nvidia.com/gpu", "must not be negative"),
    ),
    (
        "cpu in words",
        changed("policy.resources", {"requests": {"cpu": "lots"}}),
        ("spec.policy.resources.requests.cpu", "must be a Kubernetes quantity", "(got 'lots')"),
    ),
    (
        "memory with a space",
        changed("rollout.resources", {"limits": {"memory": "8 GB"}}),
        ("spec.rollout.resources.limits.memory", "must be a Kubernetes quantity"),
    ),
    (
        "resources typo",
        changed("policy.resources", {"limitz": {}}),
        ("spec.policy.resources.limitz", "Extra inputs are not permitted"),
    ),
    (
        "template not an object",
        changed("policy.template", ["pod"]),
        ("spec.policy.template", "valid dictionary"),
    ),
    (
        "template node selector value a number",
        template("policy", nodeSelector={"zone": 1}),
        ("spec.policy.template.spec.nodeSelector.zone", "must be a string (got 1)"),
    ),
    (
        "template tolerations as a string",
        template("policy", tolerations="all"),
        ("spec.policy.template.spec.tolerations", "must be a list (got 'all')"),
    ),
    (
        "template toleration not an object",
        template("rollout", tolerations=["x"]),
        ("spec.rollout.template.spec.tolerations[0]", "must be an object (got 'x')"),
    ),
    (
        "template affinity as a list",
        template("policy", affinity=[]),
        ("spec.policy.template.spec.affinity", "must be an object (got [])"),
    ),
    (
        "template service account a number",
        template("policy", serviceAccountName=7),
        ("spec.policy.template.spec.serviceAccountName", "must be a string (got 7)"),
    ),
    (
        "template without containers",
        changed("policy.template", {"spec": {"nodeSelector": {"a": "b"}}}),
        ("spec.policy.template.spec.containers: required",),
    ),
    (
        "template container without a name",
        changed("policy.template", {"spec": {"containers": [{"image": "i"}]}}),
        ("spec.policy.template.spec.containers[0].name: required",),
    ),
    (
        "template containers with one name twice",
        changed("policy.template", {"spec": {"containers": [{"name": "a"}, {"name": "a"}]}}),
        ("spec.policy.template.spec.containers[1]", "duplicate entry 'a'"),
    ),
    (
        "template unknown field",
        template("rollout", nodeSelektor={"a": "b"}),
        ("spec.rollout.template.spec.nodeSelektor: unknown field",),
    ),
    (
        "template metadata name",
        changed("policy.template", {"metadata": {"name": "x"}, "spec": WORKER_ONLY}),
        ("spec.policy.template.metadata.name: unknown field",),
    ),
    (
        "template memory with a space",
        template("policy", container={"resources": {"limits": {"memory": "8 GB"}}}),
        (
            "spec.policy.template.spec.containers[0].resources.limits.memory",
            "'8 GB' does not match",
        ),
    ),
    (
        "template pull policy unknown",
        template("policy", container={"imagePullPolicy": "Sometimes"}),
        ("spec.policy.template.spec.containers[0].imagePullPolicy", "must be one of"),
    ),
    (
        "template port past int32",
        template("policy", container={"ports": [{"containerPort": 2**31}]}),
        ("spec.policy.template.spec.containers[0].ports[0].containerPort", "int32"),
    ),
    (
        "template env valueFrom not an object",
        template("policy", container={"env": [{"name": "X", "valueFrom": "secret"}]}),
        ("spec.policy.template.spec.containers[0].env[0].valueFrom", "must be an object"),
    ),
    (
        "managedBy not a domain-prefixed path",
        changed("managedBy", "kueue"),
        ("spec.managedBy", "(got 'kueue')"),
    ),
    (
        "gang admission unknown",
        changed("gang", {"admission": "Together"}),
        ("spec.gang.admission", "(got 'Together')"),
    ),
    (
        "pod group scheduler unknown",
        changed("gang", {"admission": "PodGroup", "podGroup": {"scheduler": "Yunikorn"}}),
        ("spec.gang.podGroup.scheduler", "(got 'Yunikorn')"),
    ),
    (
        "ttl negative",
        changed("ttlSecondsAfterFinished", -5),
        ("spec.ttlSecondsAfterFinished", "greater than or equal to 0 (got -5)"),
    ),
    (
        "active deadline 0",
        changed("activeDeadlineSeconds", 0),
        ("spec.activeDeadlineSeconds", "greater than or equal to 1 (got 0)"),
    ),
    (
        "start deadline over a week",
        changed("startDeadlineSeconds", 604801),
        ("spec.startDeadlineSeconds", "less than or equal to 604800 (got 604801)"),
    ),
    (
        "active deadline over a year",
        changed("activeDeadlineSeconds", 2**62),
        ("spec.activeDeadlineSeconds", "less than or equal to 31536000"),
    ),
    (
        "ttl over a year",
        changed("ttlSecondsAfterFinished", 31536001),
        ("spec.ttlSecondsAfterFinished", "less than or equal to 31536000 (got 31536001)"),
    ),
    (
        "pod group schedule timeout over a week",
        changed("gang", {"admission": "PodGroup", "podGroup": {"scheduleTimeoutSeconds": 10**9}}),
        ("spec.gang.podGroup.scheduleTimeoutSeconds", "less than or equal to 604800"),
    ),
    (
        "start deadline as a string",
        changed("startDeadlineSeconds", "10m"),
        ("spec.startDeadlineSeconds", "valid integer"),
    ),
    (
        "weights empty",
        changed("weights", {}),
        ("spec.weights", "set exactly one of weights.synthetic and weights.safetensors"),
    ),
    (
        "weights both",
        changed("weights", {"synthetic": {}, "safetensors": {"claimName": "c"}}),
        ("spec.weights", "set exactly one of weights.synthetic and weights.safetensors"),
    ),
    (
        "synthetic layers 0",
        changed("weights", {"synthetic": {"layers": 0}}),
        ("spec.weights.synthetic.layers", "greater than or equal to 1 (got 0)"),
    ),
    (
        "synthetic layers 1e12",
        changed("weights", {"synthetic": {"layers": 10**12}}),
        ("spec.weights.synthetic.layers", "less than or equal to 4096 (got 1000000000000)"),
    ),
    (
        "synthetic hidden over 65536",
        changed("weights", {"synthetic": {"hidden": 65537}}),
        ("spec.weights.synthetic.hidden", "less than or equal to 65536 (got 65537)"),
    ),
    (
        "synthetic vocab over 2**20",
        changed("weights", {"synthetic": {"vocab": 2**20 + 1}}),
        ("spec.weights.synthetic.vocab", "less than or equal to 1048576 (got 1048577)"),
    ),
    (
        "synthetic experts over 1024",
        changed("weights", {"synthetic": {"experts": 1025}}),
        ("spec.weights.synthetic.experts", "less than or equal to 1024 (got 1025)"),
    ),
    (
        "synthetic kind wrong",
        changed("weights", {"synthetic": {"kind": "dense"}}),
        ("spec.weights.synthetic.kind", "'synthetic' (got 'dense')"),
    ),
    (
        "synthetic typo",
        changed("weights", {"synthetic": {"expert": 2}}),
        ("spec.weights.synthetic.expert", "Extra inputs are not permitted (got 2)"),
    ),
    (
        "safetensors without claim",
        changed("weights", {"safetensors": {"path": "m"}}),
        ("spec.weights.safetensors.claimName: Field required",),
    ),
    (
        "safetensors claim empty",
        changed("weights", {"safetensors": {"claimName": ""}}),
        ("spec.weights.safetensors.claimName", "at least 1 character"),
    ),
    (
        "safetensors claim a path",
        changed("weights", {"safetensors": {"claimName": "/tmp/x"}}),
        ("spec.weights.safetensors.claimName", "must be a DNS-1123 subdomain", "(got '/tmp/x')"),
    ),
    (
        "safetensors path out of the volume",
        changed("weights", {"safetensors": {"claimName": "ckpt", "path": "../etc"}}),
        ("spec.weights.safetensors.path", "relative to the volume, without '..'"),
    ),
    (
        "safetensors path absolute",
        changed("weights", {"safetensors": {"claimName": "ckpt", "path": "/models"}}),
        ("spec.weights.safetensors.path", "relative to the volume, without '..'"),
    ),
    (
        "unknown weights source",
        changed("weights", {"hf": {"repo": "x"}}),
        ("spec.weights.hf", "Extra inputs are not permitted"),
    ),
    (
        "bucket size 0",
        changed("transfer.bucketSize", "0"),
        ("spec.transfer.bucketSize", "bucketSize '0' must be more than 0 bytes"),
    ),
    (
        "bucket size 0Ki",
        changed("transfer.bucketSize", "0Ki"),
        ("spec.transfer.bucketSize", "bucketSize '0Ki' must be more than 0 bytes"),
    ),
    (
        "bucket size in MB",
        changed("transfer.bucketSize", "64MB"),
        ("spec.transfer.bucketSize", "'64MB' is not a whole number of bytes", "such as 64Mi"),
    ),
    (
        "release after refit",
        changed("transfer.releaseAfterRefit", True),
        ("spec.transfer.releaseAfterRefit", "true is not supported yet"),
    ),
    (
        "bucket size a fraction",
        changed("transfer.bucketSize", "1.5Ki"),
        ("spec.transfer.bucketSize", "'1.5Ki' must be a whole number", "write '1536'"),
    ),
    (
        "bucket size 0 unquoted",
        changed("transfer.bucketSize", 0),
        ("spec.transfer.bucketSize", "bucketSize 0 must be more than 0 bytes"),
    ),
    (
        "bucket size negative",
        changed("transfer.bucketSize", -1024),
        ("spec.transfer.bucketSize", "bucketSize -1024 must be more than 0 bytes"),
    ),
    (
        "bucket size a fraction unquoted",
        changed("transfer.bucketSize", 1.5),
        ("spec.transfer.bucketSize", "bucketSize 1.5 is not a whole number", "1048576"),
    ),
    (
        "bucket size a bool",
        changed("transfer.bucketSize", True),
        ("spec.transfer.bucketSize", "bucketSize True is not a whole number"),
    ),
    # Issue #50: each rank allocates two whole buckets; the planner needs one element.
    (
        "bucket size 1Ti",
        changed("transfer.bucketSize", "1Ti"),
        ("spec.transfer.bucketSize", "'1Ti' is 1099511627776 bytes, more than the largest"),
    ),
    (
        "bucket size 65Gi",
        changed("transfer.bucketSize", "65Gi"),
        ("spec.transfer.bucketSize", "to 64Gi (68719476736 bytes)"),
    ),
    (
        "bucket size over 64Gi unquoted",
        changed("transfer.bucketSize", (64 << 30) + 1),
        ("spec.transfer.bucketSize", "68719476737 is 68719476737 bytes, more than the largest"),
    ),
    (
        "bucket size over 64Gi in kilobytes",
        changed("transfer.bucketSize", "68719477k"),
        ("spec.transfer.bucketSize", "'68719477k' is 68719477000 bytes"),
    ),
    (
        "bucket size 1",
        changed("transfer.bucketSize", 1),
        ("spec.transfer.bucketSize", "bucketSize 1 is less than one element", "from 8 bytes"),
    ),
    (
        "bucket size '7'",
        changed("transfer.bucketSize", "7"),
        ("spec.transfer.bucketSize", "bucketSize '7' is less than one element"),
    ),
    (
        "device tpu",
        changed("transfer.device", "tpu"),
        ("spec.transfer.device", "'cpu' or 'cuda' (got 'tpu')"),
    ),
    (
        "timeout 0",
        changed("transfer.timeoutSeconds", 0),
        ("spec.transfer.timeoutSeconds", "greater than 0 (got 0)"),
    ),
    (
        "timeout infinite",
        changed("transfer.timeoutSeconds", float("inf")),
        ("spec.transfer.timeoutSeconds", "finite number (got inf)"),
    ),
    (
        "timeout 1e308",
        changed("transfer.timeoutSeconds", 1e308),
        ("spec.transfer.timeoutSeconds", "less than or equal to 86400 (got 1e+308)"),
    ),
    (
        "timeout over a day",
        changed("transfer.timeoutSeconds", 86400.5),
        ("spec.transfer.timeoutSeconds", "less than or equal to 86400 (got 86400.5)"),
    ),
    (
        "timeout with a unit",
        changed("transfer.timeoutSeconds", "2m"),
        ("spec.transfer.timeoutSeconds", "valid number (got '2m')"),
    ),
    (
        "refits 0",
        changed("transfer.refits", 0),
        ("spec.transfer.refits", "greater than or equal to 1 (got 0)"),
    ),
    (
        "refits over a million",
        changed("transfer.refits", 1_000_001),
        ("spec.transfer.refits", "less than or equal to 1000000 (got 1000001)"),
    ),
    (
        "backend empty",
        changed("transfer.backend", ""),
        ("spec.transfer.backend", "at least 1 character"),
    ),
    (
        "backend param a number",
        changed("transfer.backendParams", {"num_workers": 2}),
        ("spec.transfer.backendParams.num_workers", "valid string (got 2)"),
    ),
    (
        "flag as yes",
        changed("transfer.shardExpertWeights", "yes"),
        ("spec.transfer.shardExpertWeights", "valid boolean (got 'yes')"),
    ),
    (
        "unknown signal",
        changed("preemption.signal", "SIGBOGUS"),
        ("spec.preemption.signal", "Unknown signal name 'SIGBOGUS'"),
    ),
    (
        "SIGKILL",
        changed("preemption.signal", "SIGKILL"),
        ("spec.preemption.signal", "'SIGKILL' cannot be caught"),
    ),
    (
        "kill, short",
        changed("preemption.signal", "kill"),
        ("spec.preemption.signal", "'kill' cannot be caught"),
    ),
    (
        "signal with a space",
        changed("preemption.signal", " usr1"),
        ("spec.preemption.signal", "' usr1' must be ASCII with no surrounding spaces"),
    ),
    (
        "signal by number",
        changed("preemption.signal", 15),
        ("spec.preemption.signal", "valid string (got 15)"),
    ),
    (
        "stopSignal needs the full name",
        changed("preemption", {"signal": "usr1", "injection": "stopSignal"}),
        ("spec.preemption", "got 'usr1' (write it as 'SIGUSR1')"),
    ),
    (
        "injection unknown",
        changed("preemption.injection", "sidecar"),
        ("spec.preemption.injection", "'auto', 'stopSignal' or 'preStop' (got 'sidecar')"),
    ),
    (
        "grace 0",
        changed("preemption.gracePeriodSeconds", 0),
        ("spec.preemption.gracePeriodSeconds", "greater than or equal to 1 (got 0)"),
    ),
    (
        "grace over a day",
        changed("preemption.gracePeriodSeconds", 86401),
        ("spec.preemption.gracePeriodSeconds", "less than or equal to 86400 (got 86401)"),
    ),
    (
        "max restarts negative",
        changed("failurePolicy.maxRestarts", -1),
        ("spec.failurePolicy.maxRestarts", "(got -1)"),
    ),
    (
        "backoff negative",
        changed("failurePolicy.backoffSeconds", -0.5),
        ("spec.failurePolicy.backoffSeconds", "(got -0.5)"),
    ),
    (
        "max restarts over 10000",
        changed("failurePolicy.maxRestarts", 10_001),
        ("spec.failurePolicy.maxRestarts", "less than or equal to 10000 (got 10001)"),
    ),
    (
        "max preemptions negative",
        changed("failurePolicy.maxPreemptions", -1),
        ("spec.failurePolicy.maxPreemptions", "(got -1)"),
    ),
    (
        "max preemptions over 10000",
        changed("failurePolicy.maxPreemptions", 10_001),
        ("spec.failurePolicy.maxPreemptions", "less than or equal to 10000 (got 10001)"),
    ),
    (
        "backoff 1e308",
        changed("failurePolicy.backoffSeconds", 1e308),
        ("spec.failurePolicy.backoffSeconds", "less than or equal to 86400 (got 1e+308)"),
    ),
    (
        "max backoff over a day",
        changed("failurePolicy.maxBackoffSeconds", 86401),
        ("spec.failurePolicy.maxBackoffSeconds", "less than or equal to 86400 (got 86401)"),
    ),
    (
        "node lost over a day",
        changed("failurePolicy.nodeLostSeconds", 86401),
        ("spec.failurePolicy.nodeLostSeconds", "less than or equal to 86400 (got 86401)"),
    ),
    (
        "rollout replacements over 10000",
        changed("rollout.failurePolicy", {"maxReplacements": 10_001}),
        ("spec.rollout.failurePolicy.maxReplacements", "less than or equal to 10000"),
    ),
    (
        "rollout backoff 1e308",
        changed("rollout.failurePolicy", {"maxBackoffSeconds": 1e308}),
        ("spec.rollout.failurePolicy.maxBackoffSeconds", "(got 1e+308)"),
    ),
    (
        "service account flag a string",
        changed("createServiceAccount", "true"),
        ("spec.createServiceAccount", "valid boolean (got 'true')"),
    ),
    ("suspend as 1", changed("suspend", 1), ("spec.suspend", "valid boolean (got 1)")),
    (
        "synthetic dtype float64",
        changed("weights", {"synthetic": {"dtype": "float64"}}),
        ("spec.weights.synthetic.dtype", "'bfloat16'", "(got 'float64')"),
    ),
    (
        "synthetic dtype with torch prefix",
        changed("weights", {"synthetic": {"dtype": "torch.bfloat16"}}),
        ("spec.weights.synthetic.dtype", "(got 'torch.bfloat16')"),
    ),
    ("spec a list", ["image"], ("spec must be an object, got list",)),
    ("spec a string", "img:1", ("spec must be an object, got str",)),
]

#: (id, file text, words the loader's message must contain) for whole-manifest problems.
BAD_FILES: list[tuple[str, str, tuple[str, ...]]] = [
    ("not YAML", "spec: [unclosed\n", ("not valid YAML",)),
    (
        "no RefitJob",
        "apiVersion: batch/v1\nkind: Job\n",
        ("expected exactly one object of kind RefitJob, found 0",),
    ),
    ("two RefitJobs", "kind: RefitJob\n---\nkind: RefitJob\n", ("found 2",)),
    (
        "kind misspelt",
        f"apiVersion: {API_VERSION}\nkind: RefitJobs\nmetadata: {{name: j}}\n",
        ("found 0 (the file holds: RefitJobs; did you mean RefitJob, not RefitJobs?)",),
    ),
    (
        "old apiVersion",
        "apiVersion: refit.dev/v1\nkind: RefitJob\nmetadata: {name: j}\n",
        ("apiVersion is 'refit.dev/v1', expected 'refit.dev/v1alpha1'",),
    ),
    (
        "no name",
        f"apiVersion: {API_VERSION}\nkind: RefitJob\nspec: {{image: i}}\n",
        ("metadata.name is required",),
    ),
    (
        "name not DNS",
        f"apiVersion: {API_VERSION}\nkind: RefitJob\nmetadata: {{name: Bad_Job}}\n"
        "spec: {image: i}\n",
        ("metadata.name", "'Bad_Job' must be a DNS-1035 label"),
    ),
    (
        "name too long",
        f"apiVersion: {API_VERSION}\nkind: RefitJob\nmetadata: {{name: {'j' * 60}}}\n"
        "spec: {image: i}\n",
        ("metadata.name", "is too long", "over 63 chars"),
    ),
    (
        "no spec",
        f"apiVersion: {API_VERSION}\nkind: RefitJob\nmetadata: {{name: j}}\n",
        ("invalid spec: spec must be an object, got NoneType",),
    ),
]


#: Spec rows that YAML text cannot carry as written: kubectl sends ``replicas: 2.0`` as the
#: integer 2 (Go's JSON writes a whole float without its fraction), so the API server, and
#: ``refit run``'s loader with it, read a valid spec.  Only a JSON client can send the float.
NOT_IN_YAML: dict[str, str] = {"replicas as a float": "kubectl sends 2.0 as the integer 2"}


def _job_text(spec_lines: str) -> str:
    """A RefitJob manifest around BASE's fields and ``spec_lines`` (YAML, two-space indent)."""
    return (
        f"apiVersion: {API_VERSION}\nkind: RefitJob\nmetadata: {{name: job}}\nspec:\n"
        f"  image: img:1\n  policy: {{replicas: 1}}\n  rollout: {{replicas: 1}}\n{spec_lines}"
    )


#: Issue #50's bad inputs as a user types them: ``1e308`` and ``1e12`` are numbers to
#: kubectl (go-yaml), though not to YAML 1.1, so ``refit run`` must refuse them for their
#: bounds as the API server does, not call them "not a number".  (id, file text, words)
ISSUE_50_FILES: list[tuple[str, str, tuple[str, ...]]] = [
    (
        "bucket size 1Ti as written",
        _job_text("  transfer: {bucketSize: 1Ti}\n"),
        ("spec.transfer.bucketSize", "'1Ti' is 1099511627776 bytes, more than the largest"),
    ),
    (
        "bucket size 1 as written",
        _job_text("  transfer: {bucketSize: 1}\n"),
        ("spec.transfer.bucketSize", "bucketSize 1 is less than one element", "from 8 bytes"),
    ),
    (
        "timeout 1e308 as written",
        _job_text("  transfer: {timeoutSeconds: 1e308}\n"),
        ("spec.transfer.timeoutSeconds", "less than or equal to 86400 (got 1e+308)"),
    ),
    (
        "synthetic layers 1e12 as written",
        _job_text("  weights: {synthetic: {layers: 1e12}}\n"),
        ("spec.weights.synthetic.layers", "less than or equal to 4096 (got 1000000000000)"),
    ),
]
BAD_FILES += ISSUE_50_FILES


def manifest_text(spec: Any) -> str:
    """A whole RefitJob manifest (YAML) around ``spec``."""
    return yaml.safe_dump(
        {"apiVersion": API_VERSION, "kind": "RefitJob", "metadata": {"name": "job"}, "spec": spec}
    )
