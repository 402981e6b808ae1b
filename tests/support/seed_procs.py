"""A rollout peer that offers a committed state for seeding, in its own process.

Run as ``python -m tests.support.seed_procs <refit>``: it builds the demo's synthetic
state as of ``refit``, registers it with a real NIXL agent, offers it
(:class:`~refit_worker.engine.rollout.seed_transfer.SeedOffer`) and prints one JSON line:
its agent metadata and where the seed manifest is.  Then it obeys stdin, one command a
line, answering ``ok`` to each:

- ``corrupt <name>``: flip one byte of that committed tensor in place (as a bad copy, or a
  newer refit landing in that copy, would), without offering anything new;
- ``offer <refit>``: advance the state in place to ``refit`` and offer it;
- ``seals <json list>``: offer the same state again with these trainer seals of it
  (:class:`~refit_worker.engine.messages.signing.SealRecord`, as a receiver kept them);
- ``forge <name>``: flip one byte of that tensor and offer the result as the same refit,
  with its own (consistent) hashes and the seals it holds: a hostile seeder;
- ``exit``.
"""

from __future__ import annotations

import base64
import json
import sys

import torch

from refit_worker.contract.config import SyntheticWeights
from refit_worker.engine.messages.signing import SealRecord
from refit_worker.engine.rollout.seed_transfer import SeedOffer
from refit_worker.engine.transport.agent import NixlAgent
from refit_worker.engine.transport.registry import MemoryRegistry
from refit_worker.pod.weights import advance, synthetic_state_dict

WEIGHTS = SyntheticWeights(layers=2, hidden=64, vocab=256)


def expected_state(refit: int) -> dict[str, torch.Tensor]:
    """The demo's state carried by refit ``refit`` (after training step ``refit + 1``)."""
    return synthetic_state_dict(WEIGHTS, refit + 1)


def main() -> None:
    refit = int(sys.argv[1])
    state = expected_state(refit)
    agent = NixlAgent(progress_thread=True)
    registry = MemoryRegistry(agent, "DRAM")
    offer = SeedOffer(agent, registry, torch.device("cpu"))
    offer.publish(refit, state)
    assert offer.pointer is not None
    (addr, nbytes, dev), metadata = offer.pointer
    print(
        json.dumps(
            {
                "agent": agent.get_agent_metadata().model_dump_json(),
                "region": [addr, nbytes, dev],
                "metadata": base64.b64encode(metadata).decode(),
            }
        ),
        flush=True,
    )
    seals: list[SealRecord] = []
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        if command == "seals":
            seals = [SealRecord.model_validate(item) for item in json.loads(arg)]
            offer.publish(refit, state, seals)
        elif command == "forge":
            state[arg].reshape(-1).view(torch.uint8)[0] ^= 0xFF
            offer.publish(refit, state, seals)
        elif command == "corrupt":
            state[arg].reshape(-1).view(torch.uint8)[0] ^= 0xFF
        elif command == "offer":
            for step in range(refit + 2, int(arg) + 2):
                advance(state, step)
            refit = int(arg)
            offer.publish(refit, state)
        elif command == "exit":
            break
        print("ok", flush=True)


if __name__ == "__main__":
    main()
