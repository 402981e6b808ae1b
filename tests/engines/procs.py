"""Subprocesses of the engines tier whose stdout is a stream of JSON lines.

:class:`JsonProc` runs a command, reads its stdout on a thread (each JSON object line is
kept, anything else goes to its log file with stderr) and lets the test wait for the first
line matching a predicate, with a deadline that names what it waited for.  Nothing here
is emulated: the processes are the real engine, the real trainer.
"""

from __future__ import annotations

import json
import queue
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO


class JsonProc:
    def __init__(
        self, argv: Sequence[str], env: Mapping[str, str], log: Path, cwd: Path | None = None
    ) -> None:
        self.log_path = log
        self._log: TextIO = log.open("w")
        self.proc = subprocess.Popen(
            list(argv),
            env=dict(env),
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            text = line.strip()
            if text.startswith("{"):
                try:
                    self.lines.put(json.loads(text))
                    continue
                except json.JSONDecodeError:
                    pass
            self._log.write(line)

    def wait_for(
        self, what: str, match: Callable[[dict[str, Any]], bool], timeout: float
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    break
                continue
            self.seen.append(line)
            if match(line):
                return line
        raise TimeoutError(
            f"no {what} from pid {self.pid} within {timeout:g} s (exit code "
            f"{self.proc.poll()}); lines seen: {self.seen[-5:]}; log tail:\n{self.tail()}"
        )

    def tail(self, chars: int = 3000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self, timeout: float = 30) -> int | None:
        """Wait for a clean exit, else kill; the exit code."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._reader.join(timeout=5)
        self._log.close()
        return self.proc.returncode
