"""The ``refit`` command: ``refit crd`` prints the CRD, ``refit operator`` runs the operator.

Subcommands are small functions registered in :func:`build_parser`; a later ``refit run
MANIFEST`` (local runner) adds one more without touching the others.  kopf is imported only
by the ``operator`` subcommand.

Must not import at module level: kopf, kubernetes, the handlers (``refit crd`` needs none).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence


def _cmd_crd(args: argparse.Namespace) -> int:
    from refit_operator.crd import crd_yaml

    sys.stdout.write(crd_yaml())
    return 0


def _cmd_operator(args: argparse.Namespace) -> int:
    import kopf

    from refit_operator.handlers import run
    from refit_operator.settings import OperatorConfig

    if args.resync <= 0:
        raise SystemExit(f"refit operator: --resync must be more than 0 seconds, got {args.resync}")
    config = OperatorConfig(
        namespaces=tuple(args.namespace or ()),
        stop_signal_supported=args.stop_signal_supported,
        resync_seconds=args.resync,
        liveness=args.liveness,
    )
    kopf.configure(verbose=args.verbose)
    asyncio.run(run(config))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="refit", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    crd = sub.add_parser("crd", help="print the RefitJob CRD (YAML)")
    crd.set_defaults(func=_cmd_crd)
    op = sub.add_parser("operator", help="run the kopf operator")
    op.add_argument("--namespace", "-n", action="append", help="serve this namespace (repeat)")
    op.add_argument("--liveness", metavar="URL", help="e.g. http://0.0.0.0:8080/healthz")
    op.add_argument(
        "--stop-signal-supported",
        action="store_true",
        help="the cluster honours lifecycle.stopSignal (k8s >= 1.33, ContainerStopSignals)",
    )
    op.add_argument("--resync", type=float, default=60.0, metavar="SECONDS")
    op.add_argument("--verbose", action="store_true")
    op.set_defaults(func=_cmd_operator)
    from refit_operator.local.command import add_parser as add_run

    add_run(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
