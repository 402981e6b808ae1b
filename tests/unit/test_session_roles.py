"""A session is of its rank's role: ``RefitSession`` picks the role's class from the
config, a role's own class refuses the other role, and each role's calls exist only on
its class.  Real: the file-backed rendezvous store in a temp dir; no engine starts (a
session connects only in ``connect()``)."""

from __future__ import annotations

import inspect
import uuid
from pathlib import Path

import pytest

from refit_worker import PolicySession, RefitSession, RolloutSession
from refit_worker.contract.config import RendezvousConfig, TransferConfig, WorkerConfig
from refit_worker.contract.failures import RefusedConfigError


def _config(tmp_path: Path, role: str) -> WorkerConfig:
    return WorkerConfig(
        job="roles",
        role=role,  # type: ignore[arg-type]
        rank=0,
        policy_world_size=1,
        rollout_world_size=1,
        pod_uid=str(uuid.uuid4()),
        pod_name=f"roles-{role}-0",
        transfer=TransferConfig(bucket_size=1 << 20, device="cpu"),
        rendezvous=RendezvousConfig(store="file", location=str(tmp_path / "store")),
    )


@pytest.mark.parametrize(("role", "cls"), [("policy", PolicySession), ("rollout", RolloutSession)])
def test_refit_session_returns_the_session_of_the_configs_role(
    tmp_path: Path, role: str, cls: type[RefitSession]
) -> None:
    session = RefitSession(_config(tmp_path, role))
    try:
        assert type(session) is cls
        assert session.config.role == role
        assert not session.connection.connected  # nothing starts before connect()
    finally:
        session.close()


def test_a_roles_own_class_refuses_a_rank_of_the_other_role(tmp_path: Path) -> None:
    with pytest.raises(RefusedConfigError, match="PolicySession is for policy ranks"):
        PolicySession(_config(tmp_path, "rollout"))
    with pytest.raises(RefusedConfigError, match="RolloutSession is for rollout ranks"):
        RolloutSession(_config(tmp_path, "policy"))


def test_each_roles_calls_exist_only_on_its_session() -> None:
    assert hasattr(PolicySession, "send") and hasattr(PolicySession, "linger")
    assert not hasattr(RolloutSession, "send")
    # Both stay after the last refit for late members: a policy rank sends, a rollout
    # rank offers its copy to peers (different signatures: the policy's needs weights).
    assert "weights" in inspect.signature(PolicySession.linger).parameters
    assert "weights" not in inspect.signature(RolloutSession.linger).parameters
    for name in ("receive", "receive_into", "committed", "live_weights_partial"):
        assert hasattr(RolloutSession, name) and not hasattr(PolicySession, name), name
    # The shared surface is the base's, and it holds no state of either role.
    for name in ("connect", "close", "pending_refits", "preemption_pending", "reporter"):
        assert hasattr(RefitSession, name), name


def test_a_rollout_session_holds_no_policy_state_and_the_reverse(tmp_path: Path) -> None:
    policy = RefitSession(_config(tmp_path, "policy"))
    rollout = RefitSession(_config(tmp_path, "rollout"))
    try:
        assert "_gang" in vars(policy) and "_gang" not in vars(rollout)
        assert "_own" in vars(rollout) and "_own" not in vars(policy)
        assert policy.connection is not rollout.connection
    finally:
        policy.close()
        rollout.close()


def test_a_session_that_is_not_connected_says_so(tmp_path: Path) -> None:
    session = RefitSession(_config(tmp_path, "rollout"))
    try:
        with pytest.raises(RuntimeError, match="not connected: call connect"):
            session.connection.engine  # noqa: B018
    finally:
        session.close()
