"""The ``refit`` command: ``run`` (a RefitJob on this machine), ``operator``, ``crd``.

Subcommands are small functions registered in :func:`build_parser`; ``refit run`` lives in
``refit_operator.local.command``.  kopf is imported only by the ``operator`` subcommand.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from refit_operator.shell.settings import LeaderElection


def _cmd_crd(args: argparse.Namespace) -> int:
    from refit_operator.api.crd import crd_yaml

    sys.stdout.write(crd_yaml())
    return 0


def _cmd_operator(args: argparse.Namespace) -> int:
    import kopf

    from refit_operator.shell import credentials
    from refit_operator.shell.runtime import run
    from refit_operator.shell.settings import OperatorConfig

    try:
        election = _leader_election(args)
    except ValueError as exc:
        print(f"refit operator: {exc}", file=sys.stderr)
        return 2
    try:
        # Fail now with one line, not once per kopf retry: without credentials nothing works.
        credentials.load_credentials()
    except Exception as exc:  # the client's loader raises several types for one cause
        print(
            f"refit operator: cannot find the Kubernetes API: {exc} (not in a cluster, and "
            "no usable KUBECONFIG or ~/.kube/config)",
            file=sys.stderr,
        )
        return 2
    config = OperatorConfig(
        namespaces=tuple(args.namespace or ()),
        stop_signal_supported=args.stop_signal_supported,
        resync_seconds=args.resync,
        health=args.health_probe_bind_address,
        metrics=args.metrics_bind_address,
        leader_election=election,
    )
    kopf.configure(verbose=args.verbose)
    asyncio.run(run(config))
    return 0


def _leader_election(args: argparse.Namespace) -> LeaderElection | None:
    """The ``LeaderElection`` settings, or None without ``--leader-elect``."""
    import os

    from refit_operator.shell.leader import default_identity
    from refit_operator.shell.lease import Timing
    from refit_operator.shell.settings import LeaderElection

    if not args.leader_elect:
        return None
    namespace = args.leader_election_namespace or os.environ.get("POD_NAMESPACE", "")
    if not namespace:
        raise ValueError(
            "--leader-elect needs the Lease's namespace: --leader-election-namespace, or "
            "POD_NAMESPACE in the environment (the chart sets it from the downward API)"
        )
    timing = Timing(
        lease_duration=args.leader_elect_lease_duration,
        renew_deadline=args.leader_elect_renew_deadline,
        retry_period=args.leader_elect_retry_period,
    )
    return LeaderElection(
        namespace=namespace,
        name=args.leader_election_id,
        identity=default_identity(),
        timing=timing,
    )


def _address(text: str) -> str:
    from refit_operator.shell.endpoints import Address

    try:
        return str(Address.parse(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number > 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    from refit_operator import __version__

    parser = argparse.ArgumentParser(
        prog="refit",
        description="kube-refit: stream RL policy weights to rollout ranks over NIXL, on "
        "Kubernetes or on this machine.",
        epilog="Start with 'refit run examples/local.yaml' (no cluster needed); "
        "'refit COMMAND --help' explains each command.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from refit_operator.local.command import add_parser as add_run

    add_run(sub)
    op = sub.add_parser(
        "operator",
        help="run the operator against the cluster of the current kubeconfig",
        description="Run the kopf operator that reconciles RefitJobs. Credentials: the "
        "in-cluster service account, else KUBECONFIG or ~/.kube/config.",
    )
    _add_operator_options(op)
    _add_leader_options(op)
    _add_tuning_options(op)
    op.set_defaults(func=_cmd_operator)
    crd = sub.add_parser(
        "crd",
        help="print the RefitJob CRD as YAML (what the chart installs)",
        description="Print the RefitJob CustomResourceDefinition generated from the models.",
    )
    crd.set_defaults(func=_cmd_crd)
    return parser


def _add_operator_options(op: argparse.ArgumentParser) -> None:
    op.add_argument(
        "--namespace",
        "-n",
        action="append",
        help="serve this namespace (repeat for several; default: all namespaces)",
    )
    op.add_argument(
        "--health-probe-bind-address",
        type=_address,
        metavar="HOST:PORT",
        help="serve /healthz (liveness) and /readyz (readiness) here, e.g. :8081",
    )
    op.add_argument(
        "--metrics-bind-address",
        type=_address,
        metavar="HOST:PORT",
        help="serve Prometheus /metrics here, e.g. :8080 (may equal the probe address)",
    )


def _add_leader_options(op: argparse.ArgumentParser) -> None:
    from refit_operator.shell import lease

    op.add_argument(
        "--leader-elect",
        action="store_true",
        help="run as one of several replicas: only the holder of a coordination.k8s.io "
        "Lease reconciles, the others wait as standbys",
    )
    op.add_argument(
        "--leader-election-namespace",
        metavar="NS",
        help="namespace of the Lease (default: POD_NAMESPACE from the environment)",
    )
    op.add_argument(
        "--leader-election-id",
        default="refit-operator",
        metavar="NAME",
        help="name of the Lease (default refit-operator); replicas of one install share it",
    )
    op.add_argument(
        "--leader-elect-lease-duration",
        type=_positive_seconds,
        default=lease.LEASE_DURATION_S,
        metavar="SECONDS",
        help="a standby takes over this long after the leader last renewed (default "
        f"{lease.LEASE_DURATION_S:g})",
    )
    op.add_argument(
        "--leader-elect-renew-deadline",
        type=_positive_seconds,
        default=lease.RENEW_DEADLINE_S,
        metavar="SECONDS",
        help="the leader stops (exits) when it could not renew for this long; shorter than "
        f"the lease duration (default {lease.RENEW_DEADLINE_S:g})",
    )
    op.add_argument(
        "--leader-elect-retry-period",
        type=_positive_seconds,
        default=lease.RETRY_PERIOD_S,
        metavar="SECONDS",
        help=f"how often the Lease is renewed or tried (default {lease.RETRY_PERIOD_S:g})",
    )


def _add_tuning_options(op: argparse.ArgumentParser) -> None:
    op.add_argument(
        "--stop-signal-supported",
        action="store_true",
        help="the cluster honours lifecycle.stopSignal (k8s >= 1.33, ContainerStopSignals)",
    )
    op.add_argument(
        "--resync",
        type=_positive_seconds,
        default=60.0,
        metavar="SECONDS",
        help="reconcile every job at least this often, events or not (default 60)",
    )
    op.add_argument("--verbose", action="store_true", help="log kopf's and the API's details")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
