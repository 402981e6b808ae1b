"""``refit-vllm-serve``: a rollout pod as vLLM's OpenAI server, refitted by kube-refit.

    refit-vllm-serve [--port 8000] [--host 127.0.0.1] [--linger S] -- MODEL [vllm options]

Starts ``vllm serve MODEL`` (as ``python -m vllm.entrypoints.openai.api_server``, in this
Python) with kube-refit's backend, worker extension and vLLM's RL endpoints on, waits for
it to answer, then takes every refit of the rank's session (its ``REFIT_*`` environment)
through :class:`~.server.VllmServer`: received while the server answers, landed in one
pause, labelled ``refit-<k>@<digest>``.  One JSON line per landing on stdout
(``{"landed": ...}``).  Exits as a rollout rank does: 0 when every refit is served, 83
on the job's preemption signal, 84 when no replacement could take the refit, 2 for bad
arguments, 1 otherwise; the server is stopped first.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from refit_worker.contract.config import WorkerConfig
from refit_worker.contract.exits import EXIT_BAD_CONFIG, EXIT_PREEMPTED
from refit_worker.contract.failures import exit_code_for, one_line
from refit_worker.integrations.vllm import BACKEND, WORKER_EXTENSION
from refit_worker.integrations.vllm.serve_adapters import (
    RUNTIME_LORA_ENV,
    serve_adapter_refits,
    serve_lora_problem,
    served_adapter_landing,
)
from refit_worker.integrations.vllm.server import (
    DEV_MODE_ENV,
    ServedLanding,
    ServerRefitError,
    VllmServer,
    serve_refits,
)
from refit_worker.pod.termination import write_termination_message

log = logging.getLogger("refit-vllm-serve")

BACKEND_CONFIG = json.dumps({"backend": BACKEND})
#: Options this command sets itself; passing them after ``--`` is refused.
OWN_OPTIONS = ("--worker-extension-cls", "--weight-transfer-config", "--host", "--port")
#: How long the server may take to stop (within a pod's usual grace period).
STOP_GRACE_S = 10.0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="refit-vllm-serve",
        description=(
            "Run vLLM's OpenAI server for a rollout rank and land every kube-refit refit "
            "into it: received while it serves, landed in one pause (requests queue, the "
            "prefix cache is cleared), every response labelled with the refit's version."
        ),
        epilog="Everything after -- goes to vllm serve: the model first, then its options.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on")
    parser.add_argument("--port", type=int, default=8000, help="port to serve on")
    parser.add_argument(
        "--ready-timeout",
        type=float,
        default=900.0,
        help="seconds to wait for the server's first answer (model load included)",
    )
    parser.add_argument(
        "--linger",
        type=float,
        default=0.0,
        help="seconds to keep serving after the last refit (the step's last rollouts); "
        "the job's signal ends it early",
    )
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- MODEL [options]")
    args = parser.parse_args(argv)
    rest = list(args.serve_args)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    if not rest or rest[0].startswith("-"):
        parser.error("name the model after --: refit-vllm-serve -- MODEL [vllm serve options]")
    taken = [opt for opt in rest if opt.split("=", 1)[0] in OWN_OPTIONS]
    if taken:
        parser.error(f"{', '.join(taken)}: set by refit-vllm-serve itself (use --host/--port)")
    if not 0 <= args.linger <= 86400:
        parser.error(f"--linger {args.linger}: seconds from 0 to a day")
    if not 0 < args.port < 65536:
        parser.error(f"--port {args.port}: not a port (1..65535)")
    args.serve_args = rest
    return args


def server_command(args: argparse.Namespace) -> list[str]:
    """The ``vllm serve`` command line this rank runs."""
    model, *options = args.serve_args
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--worker-extension-cls",
        WORKER_EXTENSION,
        "--weight-transfer-config",
        BACKEND_CONFIG,
        *options,
    ]


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def report(landing: ServedLanding) -> None:
    """One JSON line and one log line per landing."""
    print(json.dumps({"landed": landing.plain()}), flush=True)
    log.info(
        "refit %d served as %s: requests held %.3f s (drain %.3f s, landing %.3f s)",
        landing.refit_id,
        landing.weight_version,
        landing.paused_s,
        landing.drain_s,
        landing.update_s,
    )


def report_adapter(committed: dict[str, Any]) -> None:
    """One JSON line per committed adapter version: the default a router sends requests
    to (``"model": <default>``) and the versions still registered."""
    print(json.dumps({"adapter": committed}), flush=True)
    log.info(
        "adapter refit %d committed: %s is the default (loaded %s)",
        committed["refit_id"],
        committed["default"],
        committed["loaded"],
    )


def drive(
    args: argparse.Namespace,
    config: WorkerConfig,
    proc: subprocess.Popen[bytes],
    stopping: Callable[[], bool],
) -> None:
    """Wait for the server, take every refit, then linger; raises what stopped it."""
    server = VllmServer(
        f"http://{args.host}:{args.port}", update_timeout_s=config.transfer.timeout_seconds
    )
    waited = server.wait_ready(args.ready_timeout, alive=lambda: proc.poll() is None)
    log.info("vllm serve answers at %s after %.1f s", server.base_url, waited)
    if config.transfer.adapter is not None:  # adapters: registered through /v1/*_lora_adapter
        landing = served_adapter_landing(server, config, args.serve_args[0], stopping)
        versions = serve_adapter_refits(landing, on_committed=report_adapter)
        log.info("every adapter refit served (%d versions registered here)", len(versions))
    else:
        server.init()
        landings = serve_refits(
            server,
            transfer_timeout_s=config.transfer.timeout_seconds,
            stop=stopping,
            on_landed=report,
        )
        server.shutdown()
        log.info("every refit served (%d landed here)", len(landings))
    if args.linger:
        log.info("serving %.0f s more (--linger)", args.linger)
        deadline = time.monotonic() + args.linger
        while time.monotonic() < deadline and not stopping() and proc.poll() is None:
            time.sleep(0.1)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = WorkerConfig.from_env()
    except Exception as exc:  # a bad REFIT_* environment: nothing started
        log.error("bad worker configuration: %s", one_line(exc))
        return EXIT_BAD_CONFIG
    stopping = {"signal": False}

    def on_signal(signum: int, frame: object) -> None:
        stopping["signal"] = True

    for sig in config.preemption_signal:
        signal.signal(sig, on_signal)
    env = {**os.environ, **DEV_MODE_ENV}
    if config.transfer.adapter is not None:
        problem = serve_lora_problem(args.serve_args[1:], config.transfer.adapter.keep)
        if problem is not None:  # refused before the server starts
            log.error("%s", problem)
            write_termination_message(problem, config.termination_message_path)
            return EXIT_BAD_CONFIG
        env.update(RUNTIME_LORA_ENV)
    # Its own process group: the job's signal reaches this driver, which stops the server.
    proc = subprocess.Popen(server_command(args), env=env, start_new_session=True)
    try:
        drive(args, config, proc, lambda: stopping["signal"])
        return 0
    except Exception as exc:
        if stopping["signal"]:
            log.info("preempted: %s", one_line(exc))
            return EXIT_PREEMPTED
        write_termination_message(one_line(exc), config.termination_message_path)
        log.error("the rollout failed: %s", one_line(exc))
        # an adapter for another base (AdapterRefused) fails the job: no replacement cures it
        return exc.exit_code if isinstance(exc, ServerRefitError) else exit_code_for(exc)
    finally:
        _stop(proc)


if __name__ == "__main__":
    sys.exit(main())
