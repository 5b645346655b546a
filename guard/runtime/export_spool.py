"""The exporter's on-disk spool: batches the collector has not acknowledged, one JSON file per
batch named by its zero-padded seq (so name order is send order), written to a temp name,
fsynced and renamed. Files outlive the process: a restarted trainer replays them first.

Also the writer-generation file (see guard/runtime/exporter.py, "Sequence numbers") and the
folders for batches the collector refused for good (rejected/, conflict/), kept for a human.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

REJECTED_DIR = "rejected"  # 400/413: the batch itself is bad
CONFLICT_DIR = "conflict"  # 409: another writer generation owns the run id


class Spool:
    """The ordered index of spooled batch files of one run and rank, and their writes.

    Its own lock covers the index only. The exporter keeps send order by holding its seq lock
    around "assign a seq, then spool if anything is spooled" (guard/runtime/export_batch.py)."""

    def __init__(self, directory: str | Path, prefix: str, stats: dict[str, int]) -> None:
        """`prefix`: "<run>-r<rank>-", shared by every file of this run and rank. `stats`: the
        exporter's counters ("spooled", "replayed" are counted here)."""
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.prefix = prefix
        self.stats = stats
        self._lock = threading.Lock()
        self._files: list[Path] = sorted(self.dir.glob(f"{prefix}*.json"))

    def __len__(self) -> int:
        with self._lock:
            return len(self._files)

    def next_generation(self) -> int:
        """This process's writer generation: its start time in whole seconds, raised above the
        last one recorded here, and recorded for the next process."""
        p = self.dir / f"{self.prefix}generation"
        try:
            last = int(p.read_text())
        except (FileNotFoundError, ValueError):
            last = 0
        gen = max(int(time.time()), last + 1)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(str(gen))
        os.replace(tmp, p)
        return gen

    def write(self, seq: int, body: bytes) -> None:
        """Spool one batch durably; it is sent after every spooled batch of a smaller seq."""
        p = self.dir / f"{self.prefix}{seq:020d}.json"
        tmp = p.with_name(f".{p.name}.tmp")
        with open(tmp, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
        with self._lock:
            bisect.insort(self._files, p)  # seq order (zero-padded names), whoever wrote it
        self.stats["spooled"] += 1

    def replay(self, send: Callable[[bytes], bool]) -> bool:
        """Send spooled batches oldest first; stop at the first failure (False)."""
        while True:
            with self._lock:
                if not self._files:
                    return True
                p = self._files[0]
            try:
                body = p.read_bytes()
            except FileNotFoundError:
                body = None
            if body is not None and not send(body):
                return False
            with self._lock:
                self._files.remove(p)
            p.unlink(missing_ok=True)
            self.stats["replayed"] += 1

    def set_aside(self, folder: str, body: bytes) -> None:
        """Keep a batch the collector refused for good in `folder` (REJECTED_DIR, CONFLICT_DIR)."""
        d = self.dir / folder
        d.mkdir(exist_ok=True)
        (d / f"{self.prefix}{time.time_ns()}.json").write_bytes(body)
