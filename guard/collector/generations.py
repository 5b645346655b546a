"""Which exporter generation writes each (run, rank), and which batches are new, duplicates or
from a writer that lost the run (seq = generation << GEN_SHIFT | counter, guard/wire/batch.py).

A rank is written by one exporter generation at a time: a newer generation takes over (a
restarted trainer); an older one's batches that were stored before are duplicates (the last seq
of each of the last RETIRED_GENERATIONS superseded generations is kept), any other is a second
writer on this run id, or a superseded trainer, and is refused. Two processes of one generation
(started within the same second) are told apart by their writer id.
"""

from __future__ import annotations

import logging
from typing import Any

from guard.collector.config import RETIRED_GENERATIONS
from guard.collector.errors import GenerationConflict
from guard.wire.batch import Batch, generation_of

log = logging.getLogger("moeguard.collector")

NEW, DUPLICATE, CONFLICT = "new", "duplicate", "conflict"


class WriterGenerations:
    """Per-rank high-water marks, the retired generations' last seqs and the owning writer ids."""

    def __init__(
        self,
        hwm: dict[int, int] | None = None,
        retired: dict[int, dict[int, int]] | None = None,
        writers: dict[int, str] | None = None,
    ) -> None:
        self.hwm = hwm or {}
        self.retired = retired or {}  # rank -> superseded generation -> its last seq
        self.writers = writers or {}  # rank -> writer id of the generation that owns it
        self._conflicts_logged: set[tuple[int, int]] = set()

    def classify(self, b: Batch) -> str:
        """NEW | DUPLICATE | CONFLICT for a batch of (run, rank)."""
        hwm = self.hwm.get(b.rank, -1)
        owner = self.writers.get(b.rank)
        if b.generation == generation_of(hwm) and None not in (b.writer, owner) and b.writer != owner:
            return CONFLICT  # one generation, two processes (both started within the same second)
        if b.seq > hwm:
            return NEW
        if b.generation == generation_of(hwm) or b.seq <= self.retired.get(b.rank, {}).get(b.generation, -1):
            return DUPLICATE
        return CONFLICT

    def owner(self, rank: int) -> int:
        """The generation that writes `rank` now (-1: none yet)."""
        hwm = self.hwm.get(rank, -1)
        return generation_of(hwm) if hwm >= 0 else -1

    def takeover_ahead(self, b: Batch, now: float) -> float:
        """Seconds by which a NEW batch that would take `b.rank` over from another generation is
        ahead of the collector's clock `now` (0 when it takes nothing over). A generation is its
        writer's start time: one in the future comes from a clock running ahead, and would own
        the rank, refusing the correctly clocked trainer, until the clock caught up."""
        cur = self.owner(b.rank)
        if cur < 0 or b.generation <= cur:
            return 0.0
        return max(0.0, b.generation - now)

    def conflict(self, run: str, b: Batch) -> GenerationConflict:
        """The error for a CONFLICT batch (logged once per rank and generation)."""
        current = generation_of(self.hwm[b.rank])
        key = (b.rank, b.generation)
        if key not in self._conflicts_logged and len(self._conflicts_logged) < 64:
            self._conflicts_logged.add(key)
            log.warning(
                "run %s rank %d: refusing batches of writer generation %d; generation %d writes this "
                "run now (two trainers on one run id?)",
                run,
                b.rank,
                b.generation,
                current,
            )
        return GenerationConflict(run, b.rank, b.generation, current)

    def accept(self, b: Batch) -> None:
        """Record a NEW batch: its seq is the rank's mark; a newer generation takes over."""
        old = self.hwm.get(b.rank, -1)
        if old >= 0 and b.generation > generation_of(old):
            gens = self.retired.setdefault(b.rank, {})
            gens[generation_of(old)] = old
            for g in sorted(gens)[:-RETIRED_GENERATIONS]:
                del gens[g]
            self.writers.pop(b.rank, None)
        self.hwm[b.rank] = b.seq
        if b.writer is not None:
            self.writers[b.rank] = b.writer

    def state_dict(self) -> dict[str, Any]:
        """For state.json (JSON keys are strings)."""
        return {
            "hwm": dict(self.hwm),
            "retired": {str(r): {str(g): v for g, v in gens.items()} for r, gens in self.retired.items()},
            "writers": {str(r): w for r, w in self.writers.items()},
        }
