"""What the collector takes from one writer, by its own rules rather than the trainer's word:
steps that strictly increase, and times no further ahead than its own clock allows (issue #32).

Pure functions over a batch's reports; RunState (run.py) keeps the marks they compare against
(rank 0's in state.json, other ranks' in memory).
"""

from __future__ import annotations

import logging

from guard.core.report import StepReport
from guard.wire.batch import MAX_CLOCK_AHEAD_S, BadRequest, Batch

log = logging.getLogger("moeguard.collector")


def increasing_steps(
    reports: list[StepReport], last: int, *, strict: bool, rank: int, generation: int
) -> tuple[list[StepReport], int]:
    """(the reports to take, the writer's last step after them). `last`: the step this writer
    (rank and generation) sent last, -1 for none. A repeat of it is left out (idempotent); a step
    before it is a BadRequest naming it, or, with `strict` False (replaying a log written before
    this rule), left out."""
    kept: list[StepReport] = []
    for i, r in enumerate(reports):
        if r.step == last:
            continue
        if r.step < last:
            if strict:
                raise BadRequest(
                    f"reports[{i}].step: {r.step} goes back from step {last}, which this writer "
                    f"(rank {rank}, generation {generation}) sent already; a writer's steps "
                    "strictly increase (a resumed trainer is a new generation)"
                )
            continue
        kept.append(r)
        last = r.step
    return kept, last


def clamp_ahead(t: float, now: float) -> tuple[float, bool]:
    """(a trainer's time `t` no further than MAX_CLOCK_AHEAD_S past the collector's `now`, whether
    it was clamped): a clock running ahead must not stretch learned intervals or goodput's span."""
    limit = now + MAX_CLOCK_AHEAD_S
    return (t, False) if t <= limit else (limit, True)


class WriterOrder:
    """One run's marks for the rules above: the last step of each rank > 0 (rank 0's is the run's
    last stored step, in state.json), and the ranks whose clock was said to run ahead."""

    def __init__(self, run: str) -> None:
        self.run = run
        self.rank_steps: dict[int, tuple[int, int]] = {}  # rank > 0 -> (generation, last step it sent)
        self.clock_warned: set[int] = set()

    def steps(self, b: Batch, rank0_last: int, rank0_gen: int, *, strict: bool) -> list[StepReport]:
        """`b`'s reports to take (`increasing_steps`); rank 0's last step and its generation come
        from the run."""
        if b.rank == 0:
            last = rank0_last if b.generation == rank0_gen else -1
        else:
            gen, step = self.rank_steps.get(b.rank, (-1, -1))
            last = step if gen == b.generation else -1
        kept, last = increasing_steps(b.reports, last, strict=strict, rank=b.rank, generation=b.generation)
        if b.rank != 0 and kept:
            self.rank_steps[b.rank] = (b.generation, last)
        return kept

    def sent(self, rank: int, sent: float, now: float) -> float:
        """A beat's trainer time, clamped to the collector's clock; said once per rank."""
        t, clamped = clamp_ahead(sent, now)
        if clamped and rank not in self.clock_warned and len(self.clock_warned) < 64:
            self.clock_warned.add(rank)
            log.warning(
                "run %s rank %d: its clock is %.0f s ahead of the collector's; its times are clamped "
                "(liveness and goodput follow the collector's clock); fix the host's clock (NTP)",
                self.run,
                rank,
                sent - now,
            )
        return t
