"""One plan per refit across the policy gang: the membership every policy rank sends a
refit by, and the gang's one verdict on how the send went.

Policy ranks used to read the rollout membership each on its own before a refit.  When R
changed between two ranks' reads, one planned refit k by the old mapping and the other
by the new one: receivers of the new mapping waited for a share that never came, and the
gang met again in the trainer's next collective only once the group's timeout restarted
it.  Here policy rank 0 alone reads the barrier and hands it to the others over the
policy role's torch.distributed group (the group the entrypoint joins, or the caller's):
a length, then the plan's JSON bytes as a uint8 tensor (never pickle).  After the send
the ranks gather one small int each, so that they all retry a refit, or none does.  A
sharded delta's offers (:mod:`refit_worker.policy.delta_source`) are exchanged the same way.

:func:`encode_plan`, :func:`decode_plan` and :func:`fold_verdict` are pure; :class:`PolicyGang`
runs the collectives (blocking: the session calls them in a worker thread).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from refit_worker.contract.config import WorkerConfig
from refit_worker.contract.entries import BarrierEntry
from refit_worker.contract.failures import RefusedConfigError
from refit_worker.signals.handler import all_gather_item, get_device

#: The length rank 0 broadcasts when it has no plan (its read failed): the others stop too.
_NO_PLAN = -1


class RefitPlan(BaseModel):
    """What every policy rank sends refit ``refit_id`` by: one membership (the barrier
    policy rank 0 read), so every manifest of the refit carries the same version and R."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: The plan's wire version: a rank of another build refuses it instead of guessing.
    v: Literal[1] = 1
    refit_id: int = Field(ge=0)
    barrier: BarrierEntry


class GangPlanError(RuntimeError):
    """Policy rank 0 sent no plan (its read of the membership failed or it was stopped),
    or a plan this rank cannot take (another refit id: the ranks' loops went apart)."""


def encode_plan(plan: RefitPlan) -> bytes:
    """The plan as JSON bytes (what goes over the group)."""
    return plan.model_dump_json().encode()


def decode_plan(data: bytes, refit_id: int) -> RefitPlan:
    """The plan in ``data``, checked to be for ``refit_id``; :class:`GangPlanError` else."""
    try:
        plan = RefitPlan.model_validate_json(data)
    except ValidationError as exc:
        raise GangPlanError(f"policy rank 0 sent a plan this rank cannot read: {exc}") from exc
    if plan.refit_id != refit_id:
        raise GangPlanError(
            f"policy rank 0 planned refit {plan.refit_id} while this rank sends refit "
            f"{refit_id}: the ranks' refit loops are not in step"
        )
    return plan


@dataclass(frozen=True, slots=True)
class Verdict:
    """The gang's word on one send: ``settled`` once any rank's targets confirmed the refit
    or already had it (a member lost on one rank gets the next refit); ``past`` once any
    rank's deadline passed (then every rank gives the refit up together)."""

    settled: bool
    past: bool


def fold_verdict(flags: Sequence[int]) -> Verdict:
    """The verdict from each rank's ``1 * settled + 2 * past + 4 * resend`` (see
    :meth:`PolicyGang.verdict`): settled once any rank delivered and no rank owes a member
    the whole refit (a declined delta), unless the time is up."""
    past = any(f & 2 for f in flags)
    resend = any(f & 4 for f in flags)
    return Verdict(any(f & 1 for f in flags) and (past or not resend), past)


def join_policy_group(config: WorkerConfig) -> None:
    """Join the policy ranks' torch.distributed group as the default group, at the role's
    rendezvous address (``REFIT_MASTER_ADDR``/``PORT``: the role's rank 0), the way the
    pod's own entrypoint does; nccl on CUDA, gloo otherwise."""
    backend = "nccl" if config.transfer.device == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{config.master_addr}:{config.master_port}",
        rank=config.rank,
        world_size=config.world_size,
        timeout=timedelta(seconds=config.transfer.timeout_seconds),
    )


class PolicyGang:
    """The policy ranks' group as the session uses it: ``group`` (None: the default group,
    when torch.distributed is initialized); a gang of one needs no group."""

    def __init__(self, group: dist.ProcessGroup | None, *, world_size: int) -> None:
        self.group, self.world_size = group, world_size
        self.shared = world_size > 1
        if not self.shared:
            return
        if group is None and not (dist.is_available() and dist.is_initialized()):
            raise RefusedConfigError(
                f"{world_size} policy ranks need their torch.distributed group to agree on "
                "each refit's membership: call init_process_group first, or pass group="
            )
        size = dist.get_world_size(group)
        if size != world_size:
            raise RefusedConfigError(
                f"the policy group has {size} ranks, the job {world_size} policy ranks"
            )
        self.leader = dist.get_rank(group) == 0
        self.device = get_device(group=group)

    def plan(self, refit_id: int, read: Callable[[], BarrierEntry]) -> BarrierEntry:
        """The membership refit ``refit_id`` is sent by: ``read()`` on rank 0, handed to
        every rank.  A failed read on rank 0 stops the others with :class:`GangPlanError`
        (not a wait for the group's timeout) and is raised on rank 0."""
        if not self.shared:
            return read()
        if self.leader:
            try:
                data = encode_plan(RefitPlan(refit_id=refit_id, barrier=read()))
            except BaseException:
                self._broadcast_length(_NO_PLAN)
                raise
            self._broadcast_length(len(data))
            self._broadcast_bytes(data)
            return RefitPlan.model_validate_json(data).barrier
        length = self._broadcast_length(0)
        if length == _NO_PLAN:
            raise GangPlanError(
                f"policy rank 0 could not plan refit {refit_id} (see its log); stopping too"
            )
        return decode_plan(self._broadcast_bytes(bytes(length)), refit_id).barrier

    def verdict(self, *, settled: bool, past: bool, resend: bool = False) -> Verdict:
        """Every rank's outcome of one send, folded the same way on each rank."""
        flag = int(settled) + 2 * int(past) + 4 * int(resend)
        if not self.shared:
            return fold_verdict([flag])
        return fold_verdict([int(f) for f in all_gather_item(flag, torch.int64, group=self.group)])

    def exchange(self, data: bytes) -> list[bytes]:
        """Every rank's ``data`` (JSON, never pickle), in rank order: the lengths, then the
        bytes padded to the longest (two all-gathers).  A sharded delta's offers go this
        way: a few bytes per changed tensor and block, never the weights."""
        if not self.shared:
            return [data]
        lengths = [int(n) for n in all_gather_item(len(data), torch.int64, group=self.group)]
        mine = torch.zeros(max(lengths), dtype=torch.uint8)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        mine = mine.to(self.device)
        gathered = [torch.empty_like(mine) for _ in lengths]
        dist.all_gather(gathered, mine, group=self.group)
        pairs = zip(gathered, lengths, strict=True)
        return [bytes(t[:n].cpu().numpy().tobytes()) for t, n in pairs]

    def _broadcast_length(self, length: int) -> int:
        tensor = torch.tensor([length], dtype=torch.int64, device=self.device)
        dist.broadcast(tensor, group=self.group, group_src=0)
        return int(tensor.item())

    def _broadcast_bytes(self, data: bytes) -> bytes:
        tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        dist.broadcast(tensor, group=self.group, group_src=0)
        return bytes(tensor.cpu().numpy().tobytes())


__all__ = [
    "GangPlanError",
    "PolicyGang",
    "RefitPlan",
    "Verdict",
    "decode_plan",
    "encode_plan",
    "fold_verdict",
]
