"""Why the collector could not take a batch or load a run (each maps to one HTTP answer)."""

from __future__ import annotations

import errno
import os
import re
from typing import Any


class StorageFailed(RuntimeError):
    pass


class RunEvicted(Exception):
    """The RunState was evicted between the lookup and the lock; look the run up again."""


class GenerationConflict(Exception):
    """A batch from an exporter generation older than the one that writes (run, rank) now."""

    def __init__(self, run: str, rank: int, generation: int, current: int) -> None:
        since = (
            f"but generation {current} has written this run since"
            if generation != current
            else "but another process of that generation (started in the same second) writes this run"
        )
        super().__init__(
            f"run {run!r} rank {rank}: generation conflict: this batch is from writer generation {generation}, "
            f"{since}. Two trainers are writing one run id, or this trainer was superseded by a restarted one. "
            "Nothing was stored; use a different run id."
        )
        self.run, self.rank, self.generation, self.current = run, rank, generation, current


class ClockAhead(GenerationConflict):
    """A writer whose generation (its start time) is ahead of the collector's clock would take a
    rank over from the generation that writes it: refused (409) instead."""

    def __init__(self, run: str, b: Any, current: int, ahead: float) -> None:
        Exception.__init__(
            self,
            f"run {run!r} rank {b.rank}: writer generation {b.generation} (its start time) is {ahead:.0f} s "
            f"ahead of the collector's clock; it may not take the rank over from generation {current}, "
            "which writes it now (a clock running ahead would own the run until it caught up). Nothing "
            "was stored; fix this host's clock (NTP).",
        )
        self.run, self.rank, self.generation, self.current = run, b.rank, b.generation, current


class RunQuarantined(StorageFailed):
    def __init__(self, run: str, reason: str) -> None:
        super().__init__(
            f"run {run} is quarantined (its files are damaged; repair them and restart the "
            f"collector): {reason}"
        )
        self.run, self.reason = run, reason


class RunDamaged(Exception):
    """A run folder this collector cannot load safely; the message says what is wrong."""


# An OS error that says nothing about a run's content: the process or the disk is short of
# something (descriptors, space, memory) or the device hiccuped. It passes; the run is retried.
TRANSIENT_ERRNOS = frozenset(
    {
        errno.EMFILE,
        errno.ENFILE,
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EFBIG,
        errno.EIO,
        errno.ENOMEM,
        errno.ENOBUFS,
        errno.EAGAIN,
        errno.EINTR,
        errno.EBUSY,
        errno.ETIMEDOUT,
    }
)
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
RETRY_AFTER_S = 1  # what a retryable answer tells the client
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # polars/pyarrow wrap OS errors in their own types


def transient_errno(e: BaseException) -> int | None:
    """The errno of a transient OS error in `e` (or its causes), None for anything else."""
    seen = 0
    cur: BaseException | None = e
    while cur is not None and seen < 8:
        if isinstance(cur, OSError) and cur.errno in TRANSIENT_ERRNOS:
            return cur.errno
        m = _RUST_OS_ERROR.search(str(cur))
        if m is not None and int(m.group(1)) in TRANSIENT_ERRNOS:
            return int(m.group(1))
        cur, seen = cur.__cause__ or cur.__context__, seen + 1
    return None


class StorageBusy(StorageFailed):
    """A transient OS error (out of descriptors, disk full, EIO): nothing stored, nothing
    quarantined; the client retries (503 with Retry-After, 507 when the disk is full)."""

    def __init__(self, run: str, what: str, err: BaseException, code: int) -> None:
        self.disk_full = code in DISK_FULL_ERRNOS
        self.status = 507 if self.disk_full else 503
        why = "disk full" if self.disk_full else os.strerror(code)
        super().__init__(
            f"run {run}: {what}: {why} ({errno.errorcode.get(code, code)}); nothing stored, retry "
            f"in {RETRY_AFTER_S} s: {str(err)[:160]}"
        )


def busy_or_none(run: str, what: str, e: BaseException) -> StorageBusy | None:
    """StorageBusy when `e` is a transient OS error, else None."""
    code = transient_errno(e)
    return None if code is None else StorageBusy(run, what, e, code)
