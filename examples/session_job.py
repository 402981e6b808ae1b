"""The README's RefitSession example as a program a RefitJob runs: policy ranks train a small
model and send its parameters once per refit; rollout ranks serve their copy and receive
each refit double-buffered beside it, so serving never sees a half refit.

Run it with ``refit run examples/session.yaml`` (its ``policy.command`` and
``rollout.command`` start this file); on a cluster, put it in the image and point the
commands there.  Outside a RefitJob pod ``RefitSession.from_env()`` says so and exits.
"""

from __future__ import annotations

import asyncio
import sys

import torch

from refit_worker import Preempted, RefitSession
from refit_worker.contract.config import ConfigError
from refit_worker.contract.exits import EXIT_BAD_CONFIG, EXIT_PREEMPTED


def build_model() -> torch.nn.Module:
    """The same architecture on both sides: a refit must match names, dtypes and shapes."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)
    )


async def trainer(model: torch.nn.Module, session: RefitSession) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    # The job's refits still to do: a gang recreated after a drain resumes where the
    # last one stopped.  Each refit's figures go to the job's status as it commits.
    for refit in session.pending_refits:
        loss = model(torch.randn(32, 256)).pow(2).mean()  # one training step
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        stats = await session.send(model.named_parameters(), refit_id=refit)
        print(f"refit {refit}: sent {stats.bytes} bytes, {stats.gbps:.3f} GB/s", flush=True)
    # A rollout replica that joined after the last refit (a replacement) gets it too.
    await session.linger(model.named_parameters())


async def serve_until_next_refit(model: torch.nn.Module) -> None:
    """Stand-in for generation: forward passes on the weights being served."""
    with torch.no_grad():
        for _ in range(4):
            model(torch.randn(8, 256))
            await asyncio.sleep(0)


async def server(model: torch.nn.Module, session: RefitSession) -> None:
    # Not a fixed range: a replica that joined late (a replacement) skips the refits it
    # missed and takes the next one sent.
    while session.pending_refits:
        generation = asyncio.create_task(serve_until_next_refit(model))
        # Lands in a spare copy while `generation` keeps serving the current weights; the
        # commit swaps the copies between two forward passes.
        stats = await session.receive_into(model, mode="double_buffer")
        await generation
        print(f"refit {stats.refit_id}: committed {stats.bytes} bytes", flush=True)
    # A replica that joins after the last refit is seeded from this one.
    await session.linger()


async def main() -> None:
    model = build_model()
    with RefitSession.from_env() as session:
        if session.config.role == "policy":
            await trainer(model, session)
        else:
            await server(model, session)


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except Preempted:
        sys.exit(EXIT_PREEMPTED)  # a preemption, not a failure: the operator resumes the job
    except ConfigError as exc:  # started outside a RefitJob pod
        print(f"session_job.py: {exc}", file=sys.stderr)
        sys.exit(EXIT_BAD_CONFIG)
