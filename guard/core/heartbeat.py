"""Per-rank heartbeats with a learned timeout (no I/O, no clock of its own: callers pass times).

The rule follows nvidia-resiliency-ext: timeout = safety_factor x the largest interval seen
between two beats of a rank, with intervals that started in a checkpoint or eval phase left out
(a 10-minute checkpoint save must not teach us that 10 minutes of silence is normal). Until a
rank has shown `min_intervals` training intervals the floor is used; the floor also bounds the
learned value from below so a 50 ms step does not page after 250 ms of GC pause.

Quiet phases (checkpoint, eval) learn their own timeout the same way: safety_factor x the longest
interval seen that started in that phase (on any rank of the run), never below the floor. Only
before the run has shown one such interval does `quiet_phase_timeout_s` (30 min) apply, so a
rank that dies in its fifth 0.1 s checkpoint pages after the floor, not after 30 minutes.

Two clocks, each used where it is right:
  * `now` (the collector's clock, when the beat arrived) measures age: "how long has it been
    silent?" must not depend on the trainer's clock being in sync.
  * `sent` (the trainer's clock, when the beat was made) measures intervals: a collector outage
    followed by a burst of spooled batches would otherwise teach a huge interval (the outage)
    and tiny ones (the burst). Differences of one host's clock are skew-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from guard.core.tomlconf import check

PHASE_TRAIN = "train"  # inside a step: forward, backward, the update
PHASE_DATA = "data"  # waiting for the data loader's next batch (GuardedStep.batches())
PHASE_CHECKPOINT = "checkpoint"
PHASE_EVAL = "eval"
PHASES = (PHASE_TRAIN, PHASE_CHECKPOINT, PHASE_EVAL, PHASE_DATA)
# Phases a rank spends every step: their intervals teach the rank's own timeout. The others
# (checkpoint, eval) are quiet phases that teach only their own.
BUSY_PHASES = (PHASE_TRAIN, PHASE_DATA)


@dataclass(kw_only=True, slots=True)
class HeartbeatConfig:
    safety_factor: float = 5.0
    floor_s: float = 30.0  # never call a rank lost sooner than this
    min_intervals: int = 10  # training intervals seen before the learned value applies
    quiet_phase_timeout_s: float = 1800.0  # checkpoint/eval timeout before one was seen to end

    def __post_init__(self) -> None:
        check(self.safety_factor >= 1.0, "safety_factor", self.safety_factor, "must be >= 1")
        check(self.floor_s > 0, "floor_s", self.floor_s, "must be > 0")
        check(self.min_intervals >= 1, "min_intervals", self.min_intervals, "must be >= 1")
        check(
            self.quiet_phase_timeout_s > 0, "quiet_phase_timeout_s", self.quiet_phase_timeout_s, "must be > 0"
        )


@dataclass(slots=True)
class RankBeat:
    last_seen: float  # collector clock
    last_sent: float  # trainer clock
    step: int
    phase: str
    max_interval: float = 0.0
    n_intervals: int = 0


class HeartbeatTracker:
    """Last beat and learned timeout per rank of one run."""

    def __init__(self, cfg: HeartbeatConfig | None = None) -> None:
        self.cfg = cfg or HeartbeatConfig()
        self.ranks: dict[int, RankBeat] = {}
        self.quiet_max: dict[str, float] = {}  # checkpoint/eval -> longest interval started in it

    def beat(
        self, rank: int, now: float, step: int, phase: str = PHASE_TRAIN, sent: float | None = None
    ) -> None:
        """Record a beat of `rank` that arrived at `now` (made at `sent`, trainer clock)."""
        if phase not in PHASES:
            raise ValueError(f"phase {phase!r} not one of {PHASES}")
        sent = now if sent is None or not math.isfinite(sent) else sent
        rb = self.ranks.get(rank)
        if rb is None:
            self.ranks[rank] = RankBeat(last_seen=now, last_sent=sent, step=step, phase=phase)
            return
        if sent <= rb.last_sent:
            # A replayed or reordered beat says nothing new about intervals; it still proves life.
            rb.last_seen = max(rb.last_seen, now)
            return
        interval = sent - rb.last_sent
        if rb.phase in BUSY_PHASES:  # the interval started while training: it counts
            rb.max_interval = max(rb.max_interval, interval)
            rb.n_intervals += 1
        else:  # a quiet phase teaches only its own timeout
            self.quiet_max[rb.phase] = max(self.quiet_max.get(rb.phase, 0.0), interval)
        rb.last_seen = max(rb.last_seen, now)
        rb.last_sent = sent
        rb.step = max(rb.step, step)
        rb.phase = phase

    def timeout(self, rank: int) -> float:
        """Seconds of silence after which `rank` counts as lost."""
        rb = self.ranks.get(rank)
        cfg = self.cfg
        if rb is None:
            return cfg.floor_s
        learned = cfg.safety_factor * rb.max_interval if rb.n_intervals >= cfg.min_intervals else 0.0
        t = max(cfg.floor_s, learned)
        if rb.phase not in BUSY_PHASES:
            quiet = self.quiet_max.get(rb.phase)
            t = max(t, cfg.quiet_phase_timeout_s if quiet is None else cfg.safety_factor * quiet)
        return t

    def age(self, rank: int, now: float) -> float:
        rb = self.ranks.get(rank)
        return math.nan if rb is None else max(0.0, now - rb.last_seen)

    def lost(self, now: float) -> dict[int, bool]:
        """rank -> True when it has been silent for longer than its timeout."""
        return {r: self.age(r, now) > self.timeout(r) for r in self.ranks}

    def last_seen(self) -> dict[int, float]:
        return {r: rb.last_seen for r, rb in self.ranks.items()}
