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

Many ranks (issue #30). A rank's own beats come at a declared, bounded rate (`beat_interval_s`:
the collector's load from one run stays under BEAT_BUDGET_PER_S however many ranks it has), and
carry it (`every`): such a rank is lost after max(floor, DECLARED_FACTOR x every, the learned
rule). Between them, rank 0's report of a new step proves every rank of the job alive: the
guard's per-step collectives (the probe's all-reduce, the decision agreement) completed on all
`world` ranks. `cover()` records that proof once per step, O(1), instead of a beat per rank, so
the collector's per-step work does not grow with the rank count.
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

# A run's own-beat budget: its ranks together send at most this many heartbeats a second, so a
# 16,384-rank job costs a collector what 256 ranks beating every second would (guard/runtime's
# exporter and docs/ARCHITECTURE.md; bench/scale/rank_scale.py measures it).
BEAT_BUDGET_PER_S = 256.0
# A rank that declares its beat interval is lost after this many intervals of silence (at least).
DECLARED_FACTOR = 2.5


def beat_interval_s(world: int, base_s: float) -> float:
    """Seconds between one rank's own beats in a job of `world` ranks: `base_s`, stretched so the
    job's ranks together stay under BEAT_BUDGET_PER_S (16,384 ranks: 64 s)."""
    return max(base_s, world / BEAT_BUDGET_PER_S)


def first_beat_delay_s(rank: int, world: int, interval_s: float) -> float:
    """When a rank's first own beat is due: ranks spread evenly over one interval, so a job that
    starts (or stalls) at once does not beat at once."""
    return interval_s * ((rank % max(world, 1)) / max(world, 1))


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
    every: float = 0.0  # the rank's declared beat interval (0: none declared)


class HeartbeatTracker:
    """Last beat and learned timeout per rank of one run."""

    def __init__(self, cfg: HeartbeatConfig | None = None) -> None:
        self.cfg = cfg or HeartbeatConfig()
        self.ranks: dict[int, RankBeat] = {}
        self.quiet_max: dict[str, float] = {}  # checkpoint/eval -> longest interval started in it
        # rank 0's per-step proof that ranks 0..world-1 are alive (None: no multi-rank proof yet)
        self.covered: RankBeat | None = None
        self.world = 0
        self.ended: set[int] = set()  # ranks that stopped on purpose (not covered any more)
        self.max_every = 0.0  # the longest own-beat interval any rank declared (a job's are equal)

    def beat(
        self,
        rank: int,
        now: float,
        step: int,
        phase: str = PHASE_TRAIN,
        sent: float | None = None,
        every: float = 0.0,
    ) -> None:
        """Record a beat of `rank` that arrived at `now` (made at `sent`, trainer clock; `every`:
        the interval the rank declares for its own beats, 0 if none)."""
        if phase not in PHASES:
            raise ValueError(f"phase {phase!r} not one of {PHASES}")
        sent = now if sent is None or not math.isfinite(sent) else sent
        self.ended.discard(rank)
        self.max_every = max(self.max_every, every)
        rb = self.ranks.get(rank)
        if rb is None:
            self.ranks[rank] = RankBeat(last_seen=now, last_sent=sent, step=step, phase=phase, every=every)
            return
        rb.every = every
        self._learn(rb, now, step, phase, sent)

    def cover(
        self, world: int, now: float, step: int, phase: str = PHASE_TRAIN, sent: float | None = None
    ) -> None:
        """A beat of rank 0 in a `world`-rank job. A new step proves every rank alive (each was in
        that step's collectives); the same step only tells rank 0's phase (a checkpoint that
        follows it must not teach the proof's interval)."""
        sent = now if sent is None or not math.isfinite(sent) else sent
        self.world = max(self.world, world)
        cv = self.covered
        if cv is None:
            self.covered = RankBeat(last_seen=now, last_sent=sent, step=step, phase=phase)
        elif step > cv.step or (step < cv.step and sent > cv.last_sent):  # a resume starts lower
            if step < cv.step:
                cv.step = step
            self._learn(cv, now, step, phase, sent)
        else:
            cv.phase = phase

    def _learn(self, rb: RankBeat, now: float, step: int, phase: str, sent: float) -> None:
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

    def is_covered(self, rank: int) -> bool:
        return self.covered is not None and rank < self.world and rank not in self.ended

    def expected(self) -> list[int]:
        """Every rank watched: those that beat and those rank 0's proof covers."""
        covered = range(self.world) if self.covered is not None else range(0)
        if not self.ended and (not self.ranks or max(self.ranks) < len(covered)):
            return list(covered)  # the common case, without building a set of every rank
        return sorted(set(self.ranks) | {r for r in covered if r not in self.ended})

    def _learned(self, rb: RankBeat | None) -> float:
        cfg = self.cfg
        if rb is None or rb.n_intervals < cfg.min_intervals:
            return 0.0
        return cfg.safety_factor * rb.max_interval

    def timeout(self, rank: int) -> float:
        """Seconds of silence after which `rank` counts as lost."""
        rb = self.ranks.get(rank)
        cfg = self.cfg
        if rb is None:  # covered, not heard from yet: its first beat may be one declared interval away
            if not self.is_covered(rank):
                return cfg.floor_s
            return max(cfg.floor_s, self._learned(self.covered), DECLARED_FACTOR * self.max_every)
        if rb.every > 0:  # declared own beats: their silence is judged by them, the rest by the proof
            learned = max(DECLARED_FACTOR * rb.every, self._learned(self.covered))
        else:
            learned = self._learned(rb)
        t = max(cfg.floor_s, learned)
        if rb.phase not in BUSY_PHASES:
            quiet = self.quiet_max.get(rb.phase)
            t = max(t, cfg.quiet_phase_timeout_s if quiet is None else cfg.safety_factor * quiet)
        return t

    def seen(self, rank: int) -> float:
        """When the collector last heard from `rank` or had rank 0's proof of it (NaN: never)."""
        rb = self.ranks.get(rank)
        own = rb.last_seen if rb is not None else -math.inf
        cv = self.covered
        proof = cv.last_seen if cv is not None and self.is_covered(rank) else -math.inf
        t = max(own, proof)
        return math.nan if t == -math.inf else t

    def age(self, rank: int, now: float) -> float:
        t = self.seen(rank)
        return math.nan if math.isnan(t) else max(0.0, now - t)

    def lost(self, now: float) -> dict[int, bool]:
        """rank -> True when it has been silent for longer than its timeout."""
        return {r: self.age(r, now) > self.timeout(r) for r in self.expected()}

    def proof_fresh(self, now: float) -> bool:
        """Whether rank 0's proof alone shows every covered rank alive and on time now (then a
        scrape need not look at each one)."""
        cv = self.covered
        return cv is not None and now - cv.last_seen <= 0.5 * self.cfg.floor_s

    def end(self, rank: int | None = None) -> None:
        """Stop watching `rank` (every rank, and the proof, if None)."""
        if rank is None:
            self.ranks.clear()
            self.covered, self.world, self.max_every = None, 0, 0.0
            self.ended.clear()
            return
        self.ranks.pop(rank, None)
        if rank < self.world:
            self.ended.add(rank)

    def last_seen(self) -> dict[int, float]:
        return {r: rb.last_seen for r, rb in self.ranks.items()}
