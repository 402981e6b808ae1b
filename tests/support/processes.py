"""Process helpers shared by the e2e and reliability tests and the benches.

Real processes only: these read ``/proc`` and bind real sockets; nothing is emulated.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path


def processes_under(path: Path) -> list[int]:
    """Pids whose working directory lies under ``path`` (every local pod's cwd does), so a
    test can show what a run left behind."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue  # gone, or not ours to look at
        if cwd.startswith(str(path)):
            found.append(int(entry.name))
    return found


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
