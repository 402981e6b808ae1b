"""A RefitJob's ranks as real ``refit-worker`` processes, with the test as its coordinator.

:class:`DemoJob` starts policy and rollout ranks (``python -m refit_worker``: real gloo for
the policy gang, real NIXL/UCX transfers, the file-backed rendezvous store) and plays the
operator's part of the membership protocol: it keeps which pod (uid, generation) holds
each rank now, and a thread writes the barrier the contract's pure
:func:`~refit_worker.contract.rendezvous.membership` decides from the store's snapshot,
the way ``core/coordinate.py`` does.  Pods are killed with real signals (``os.kill``);
a replacement is a new process under a new uid, started while the old one may still be
around, as on a cluster.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.processes import free_port

from refit_worker.contract.config import (
    RendezvousConfig,
    SyntheticWeights,
    TransferConfig,
    WorkerConfig,
)
from refit_worker.contract.rendezvous import (
    BARRIER_KEY,
    BarrierEntry,
    Layout,
    LivePod,
    membership,
    read_snapshot,
)
from refit_worker.contract.roles import Role
from refit_worker.rendezvous import FileStore

ROOT = Path(__file__).resolve().parents[2]
#: How often the coordinator re-decides the membership (the operator reacts to watch events).
COORDINATE_S = 0.1


@dataclass
class Pod:
    role: str
    rank: int
    uid: str
    generation: int
    epoch: int
    proc: subprocess.Popen[bytes]
    log: Path


@dataclass
class DemoJob:
    """One job's ranks and its coordinator; use as a context manager."""

    tmp: Path
    policy: int = 1
    rollout: int = 2
    refits: int = 6
    timeout_s: float = 60.0
    weights: SyntheticWeights = field(
        default_factory=lambda: SyntheticWeights(
            layers=2, hidden=64, vocab=256, dtype="bfloat16", seed=5
        )
    )
    epoch: int = 0
    pods: dict[tuple[str, int], Pod] = field(default_factory=dict)
    gone: list[Pod] = field(default_factory=list)
    barriers: list[BarrierEntry] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.store_dir = self.tmp / "rdzv"
        self.store = FileStore(self.store_dir, Layout(self.policy, self.rollout, 1))
        self._port = free_port()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._coordinate, daemon=True)
        self.errors: list[BaseException] = []
        #: The desired rollout replica count R (``kubectl scale``): the coordinator's own.
        self.desired = self.rollout

    def __enter__(self) -> DemoJob:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        for pod in [*self.pods.values(), *self.gone]:
            if pod.proc.poll() is None:
                pod.proc.kill()
                pod.proc.wait(10)

    # -- pods ---------------------------------------------------------------------------

    def start(self, role: str, rank: int, *, generation: int = 0, first_refit: int = 0) -> Pod:
        """Start the pod of ``role`` rank ``rank`` (a new uid) and make it the live one."""
        uid = str(uuid.uuid4())
        name = f"demo-{role}-{rank}-" + (f"e{self.epoch}" if role == "policy" else f"g{generation}")
        config = WorkerConfig(
            job="demo",
            role=role,  # type: ignore[arg-type]
            rank=rank,
            policy_world_size=self.policy,
            rollout_world_size=self.desired,  # the operator renders spec.rollout.replicas
            epoch=self.epoch,
            generation=generation,
            pod_uid=uid,
            pod_name=name,
            master_port=self._port,
            first_refit=first_refit,
            weights=self.weights,
            transfer=TransferConfig(
                bucket_size=64 << 10, refits=self.refits, timeout_seconds=self.timeout_s
            ),
            rendezvous=RendezvousConfig(store="file", location=str(self.store_dir)),
        )
        env = {
            **os.environ,
            **config.to_env(),
            "PYTHONPATH": os.pathsep.join([str(ROOT / "worker"), str(ROOT / "operator")]),
        }
        log = self.tmp / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "refit_worker"],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        pod = Pod(role, rank, uid, generation, self.epoch, proc, log)
        with self._lock:
            old = self.pods.get((role, rank))
            if old is not None:
                self.gone.append(old)
            self.pods[(role, rank)] = pod
        return pod

    def kill(self, pod: Pod) -> None:
        """SIGKILL ``pod`` (a lost node, an OOM kill); its slot has no live pod until a
        replacement is started."""
        os.kill(pod.proc.pid, 9)
        pod.proc.wait(30)
        with self._lock:
            if self.pods.get((pod.role, pod.rank)) is pod:
                del self.pods[(pod.role, pod.rank)]
                self.gone.append(pod)

    def new_policy_epoch(self, first_refit: int) -> list[Pod]:
        """Recreate the policy gang in the next epoch (after its pods are gone)."""
        with self._lock:
            self.epoch += 1
            self._port = free_port()
        return [self.start("policy", rank, first_refit=first_refit) for rank in range(self.policy)]

    def scale(self, replicas: int) -> None:
        """Set the desired rollout replica count (ranks past it leave at a refit boundary)."""
        with self._lock:
            self.desired = replicas

    # -- coordinator ----------------------------------------------------------------------

    def _live(self) -> dict[tuple[Role, int], LivePod]:
        with self._lock:
            return {
                (pod.role, pod.rank): LivePod(pod.uid, pod.generation, pod.proc.poll() is None)  # type: ignore[misc]
                for pod in self.pods.values()
            }

    def _coordinate(self) -> None:
        previous: BarrierEntry | None = None
        while not self._stop.wait(COORDINATE_S):
            try:
                with self._lock:
                    epoch = self.epoch
                if previous is not None and previous.epoch != epoch:
                    previous = None
                with self._lock:
                    desired = self.desired
                snap = read_snapshot(self.store.read_data(), epoch, self.policy, desired)
                barrier = membership(snap, self.policy, desired, self._live(), previous)
                if barrier is not None:
                    self.store.put_entry(BARRIER_KEY, barrier)
                    self.barriers.append(barrier)
                    previous = barrier
            except Exception as exc:  # the test reports it
                self.errors.append(exc)
                return

    # -- reading --------------------------------------------------------------------------

    def wait_for(self, what: str, check: object, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not check():  # type: ignore[operator]
            if self.errors:
                raise AssertionError(f"coordinator failed: {self.errors[0]!r}\n{self.logs()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}\n{self.logs()}")
            time.sleep(0.05)

    def progress(self) -> dict[tuple[str, int], object]:
        return dict(self.store.progress_all())

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}"
            for p in sorted(self.tmp.glob("*.log"))
        )
