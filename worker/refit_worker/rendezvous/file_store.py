"""The file-backed rendezvous store, for local runs: same keys, same entries, no cluster.

Layout: ``<directory>/shard-<i>/<key>``, one file per key, so writers of different keys
never touch the same file.  A write goes to a temporary file in the same directory and is
renamed over the key (atomic on POSIX): a reader sees the old value or the new one,
never a torn one.  Waits poll (``refit_worker.contract.waits.poll_until``) with a bounded back-off,
5 ms growing to 200 ms.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from refit_worker.contract.entries import TruncatedValue
from refit_worker.contract.rendezvous import Layout, is_valid_data_key, max_value_bytes
from refit_worker.contract.waits import Backoff, CancelFlag, poll_until
from refit_worker.rendezvous.store import Check, RendezvousStore, RendezvousTimeout, T

_TMP_PREFIX = ".tmp-"
_BACKOFF = Backoff(first=0.005, cap=0.2)
#: A file longer than any entry may be is read only this far: decoding then reports it
#: as oversized instead of this process reading a huge file.
_READ_LIMIT = max(max_value_bytes(kind) for kind in ("meta", "progress", "barrier", "preempt"))


class FileStore(RendezvousStore):
    """Rendezvous over a directory shared by the processes of one machine."""

    def __init__(self, directory: str | os.PathLike[str], layout: Layout) -> None:
        super().__init__(layout)
        self.directory = Path(directory)
        for shard in range(layout.shards):
            self._shard_dir(shard).mkdir(parents=True, exist_ok=True)

    def _shard_dir(self, shard: int) -> Path:
        if not 0 <= shard < self.layout.shards:
            raise ValueError(f"shard {shard} is outside 0..{self.layout.shards - 1}")
        return self.directory / f"shard-{shard}"

    def _put(self, shard: int, key: str, value: str) -> None:
        if not _is_file_key(key):
            raise ValueError(f"{key!r} is not a valid rendezvous key")
        folder = self._shard_dir(shard)
        folder.mkdir(parents=True, exist_ok=True)  # a shard the layout grew to
        fd, tmp = tempfile.mkstemp(prefix=f"{_TMP_PREFIX}{key}-", dir=folder)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write(value)
            # No fsync: the store lives as long as the local run; readers need atomicity,
            # not durability across a power cut.
            os.replace(tmp, folder / key)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def read_shard(self, shard: int) -> dict[str, str]:
        """All raw keys of ``shard`` (what a ConfigMap's ``data`` would show)."""
        return self._read(shard)

    def patch_shard(self, shard: int, patch: Mapping[str, str | None]) -> None:
        """Apply a JSON merge patch of ``data`` to ``shard``: set keys, None deletes.

        The local runner applies the coordinator's ConfigMap patches with this.  Each key
        changes atomically; the patch as a whole does not (nor need it: every reader
        takes keys one by one).  An invalid key is refused before anything changes.
        """
        folder = self._shard_dir(shard)
        bad = [key for key in patch if not _is_file_key(key)]
        if bad:
            raise ValueError(f"not valid rendezvous keys: {', '.join(map(repr, bad))}")
        for key, value in patch.items():
            if value is None:
                (folder / key).unlink(missing_ok=True)
            else:
                self._put(shard, key, value)

    def _read(self, shard: int) -> dict[str, str]:
        data: dict[str, str] = {}
        folder = self._shard_dir(shard)
        if not folder.is_dir():
            return data  # a shard the layout grew to (a scale-up) that nobody wrote yet
        for path in folder.iterdir():
            if not _is_file_key(path.name):
                continue  # a temporary file of a write under way, or not ours
            try:
                with path.open("rb") as src:
                    raw = src.read(_READ_LIMIT + 1)
                    size = os.fstat(src.fileno()).st_size
            except FileNotFoundError:
                continue  # removed between listing and reading: as if never listed
            text = raw.decode("utf-8", errors="replace")
            # Too large to read whole: the size check must still quote its real size.
            data[path.name] = TruncatedValue(text, size) if size > _READ_LIMIT else text
        return data

    def _wait(
        self,
        shards: Sequence[int],
        check: Check[T],
        timeout: float,
        what: str,
        cancel: CancelFlag | None,
    ) -> T:
        def merged() -> T | None:
            data: dict[str, str] = {}
            for shard in shards:
                data.update(self._home(shard, self._read(shard)))
            return check(data)

        return poll_until(
            merged,
            timeout=timeout,
            what=f"{what} in {self.directory}",
            backoff=_BACKOFF,
            cancel=cancel,
            error=RendezvousTimeout,
        )

    def close(self) -> None:
        """Nothing to release: every call opens and closes its own files."""


def _is_file_key(key: str) -> bool:
    # A ConfigMap data key, and never a dot-name (temporary files, "." and "..").
    return is_valid_data_key(key) and not key.startswith(".")
