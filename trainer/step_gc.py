"""CPython's cyclic GC at step boundaries (`train.gc_every`), as torchtitan (`training.gc_freq`)
and Megatron-LM (`--manual-gc`) run it.

Left automatic, the GC collects whenever a rank's own allocations trip its thresholds, so the ranks
of a job pause at different steps and every pause on one rank stalls the others at the next
collective. For the run, StepGC turns the automatic collections off, collects the young
generations every `gc_every` steps (the same step on every rank) and everything at each
checkpoint (cycles that outlived a young collection). What was built before the first step (the
imports, the model, the optimizer: kept for the run anyway) is frozen out of those collections, so
they scan only what the run makes; a full collection over that heap cost ~0.1 s on the tiny CPU
configs and more with every import. Everything is put back as it was when the run ends, so a run
inside a longer-lived process (a test, a notebook) leaves its GC as it found it.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


class StepGC:
    """start() before the first step, after_step(step) after each, at_checkpoint() after each
    periodic save, restore() when the run ends however it ends. every = 0: CPython's automatic GC,
    untouched."""

    def __init__(self, every: int) -> None:
        self.every = every
        self._was_enabled: bool | None = None  # None: not started (or restored)

    def start(self) -> None:
        if self.every and self._was_enabled is None:
            self._was_enabled = gc.isenabled()
            gc.disable()
            gc.freeze()

    def after_step(self, step: int) -> None:
        if self._was_enabled is not None and step % self.every == 0:
            gc.collect(1)

    def at_checkpoint(self) -> None:
        if self._was_enabled is not None:
            gc.collect()

    def restore(self) -> None:
        if self._was_enabled is not None:
            gc.unfreeze()
            if self._was_enabled:
                gc.enable()
            self._was_enabled = None


@contextlib.contextmanager
def gc_off_through_start_up(every: int) -> Iterator[None]:
    """`moeguard train` from its heavy imports (torch, the model, the optimizer) to the run's end,
    when the run collects at step boundaries: the automatic GC ran ~5 full collections over the
    growing heap of the imports (~0.6-0.8 CPU-s of a rank's start-up here), and StepGC.start()
    freezes what they leave rather than scanning it. Back as it was afterwards (an in-process call
    of the CLI, in a test, keeps its GC)."""
    was_enabled = gc.isenabled()
    if every:
        gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
