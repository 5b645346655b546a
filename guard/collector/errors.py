"""Why the collector could not take a batch or load a run (each maps to one HTTP answer)."""

from __future__ import annotations


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


class RunQuarantined(StorageFailed):
    def __init__(self, run: str, reason: str) -> None:
        super().__init__(
            f"run {run} is quarantined (its files are damaged; repair them and restart the "
            f"collector): {reason}"
        )
        self.run, self.reason = run, reason


class RunDamaged(Exception):
    """A run folder this collector cannot load safely; the message says what is wrong."""
