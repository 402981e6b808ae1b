"""The last word of a failing worker: a short reason in the container's termination message.

The kubelet copies the file at ``terminationMessagePath`` into the pod's status
(``state.terminated.message``); the operator copies that into the RefitJob's status and a
Warning Event, so ``kubectl get rj`` says why a rank failed after its logs are gone.
"""

from __future__ import annotations

import logging
import os

from refit_worker.contract.config import TERMINATION_MESSAGE_PATH
from refit_worker.contract.env import ENV_PREFIX

log = logging.getLogger(__name__)

#: The kubelet keeps at most 4096 bytes of a termination message.
MAX_MESSAGE_BYTES = 4096
#: The variable that names the path when the config as a whole cannot be read.
PATH_ENV = f"{ENV_PREFIX}TERMINATION_MESSAGE_PATH"


def write_termination_message(reason: str, path: str | None = None) -> bool:
    """Write ``reason`` (cut to the kubelet's limit) where the kubelet reads it; best effort.

    Returns whether it was written: outside a pod the default path is usually not there,
    and a worker must not fail a second time for that.
    """
    target = path or os.environ.get(PATH_ENV) or TERMINATION_MESSAGE_PATH
    data = reason.encode("utf-8", errors="replace")[:MAX_MESSAGE_BYTES]
    try:
        with open(target, "wb") as out:
            out.write(data)
    except OSError as exc:
        log.debug("no termination message written to %s: %s", target, exc)
        return False
    return True
