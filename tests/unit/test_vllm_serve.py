"""refit-vllm-serve's arguments and the server driver's waits (no vLLM needed here; the
cluster tier runs the whole thing: tests/cluster/test_rl_vllm.py)."""

from __future__ import annotations

import json
import socket

import pytest

from refit_worker.contract.exits import EXIT_BAD_CONFIG
from refit_worker.integrations.vllm import BACKEND, WORKER_EXTENSION
from refit_worker.integrations.vllm.serve import main, parse_args, server_command
from refit_worker.integrations.vllm.server import BackendState, ServerRefitError, VllmServer


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_the_server_command_carries_the_backend_the_extension_and_the_model() -> None:
    args = parse_args(["--port", "8123", "--", "/models/llama", "--dtype", "bfloat16"])
    command = server_command(args)
    assert command[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "/models/llama"]
    assert command[command.index("--port") + 1] == "8123"
    assert command[command.index("--worker-extension-cls") + 1] == WORKER_EXTENSION
    assert json.loads(command[command.index("--weight-transfer-config") + 1]) == {
        "backend": BACKEND
    }
    assert command[-2:] == ["--dtype", "bfloat16"]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--"], "name the model after --"),
        (["--", "--dtype", "float32"], "name the model after --"),
        (["--", "m", "--port", "9"], "--port: set by refit-vllm-serve itself"),
        (["--", "m", "--weight-transfer-config={}"], "set by refit-vllm-serve itself"),
        (["--port", "0", "--", "m"], "--port 0: not a port"),
        (["--linger", "-1", "--", "m"], "--linger -1.0: seconds from 0 to a day"),
    ],
)
def test_bad_arguments_are_refused_by_name(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        parse_args(argv)
    assert stopped.value.code == 2
    assert says in capsys.readouterr().err


def test_without_a_worker_environment_nothing_starts(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("REFIT_JOB", raising=False)
    assert main(["--", "/models/none"]) == EXIT_BAD_CONFIG
    assert "bad worker configuration" in caplog.text


def test_waiting_for_a_server_that_exited_or_never_answers_ends_with_why() -> None:
    server = VllmServer(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(ServerRefitError, match="exited before it answered /health"):
        server.wait_ready(60, alive=lambda: False)
    with pytest.raises(ServerRefitError, match=r"did not answer .*/health within 1 s"):
        server.wait_ready(1)


def test_the_backend_state_parses_from_plain_data() -> None:
    state = BackendState.parse(
        {"pending": [2, 3], "staged": 2, "ready": True, "weight_version": None, "error": None}
    )
    assert (state.pending, state.staged, state.ready) == ((2, 3), 2, True)
