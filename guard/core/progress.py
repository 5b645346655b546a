"""Progress deadlines: a run whose heartbeats go on while its step does not advance (no I/O, no
clock of its own: callers pass times).

A hung collective is the common real hang: every rank sits in an all-reduce at 100% utilisation,
its process alive and its exporter beating, so HeartbeatLost never fires. What stops is
progress: the step a rank reports, or the phase it says it is in (train, checkpoint, eval).

Each beat carries the rank's step and phase. A beat with a higher step or another phase is
progress; the time since the previous progress (trainer clock, so spooled bursts after a
collector outage measure the real durations) is one completed duration of the phase the rank
was in. The run learns, per phase, the longest duration any of its ranks completed, and
    deadline(phase) = max(floor_s, safety_factor x longest duration of that phase)
or `first_deadline_s` while the phase has never completed (the first checkpoint of a run, the
first eval). A rank is stuck when the time since its last progress (collector clock: "how long
has nothing moved" must not depend on the trainer's clock) exceeds the deadline of its phase;
the collector only calls it stuck while its heartbeat is alive (a silent rank is HeartbeatLost).

Start-up: the interval from a rank's first beat (of a new exporter generation: a new or
restarted trainer) to its first progress holds process start, compilation and the first step;
it is not learned, and its deadline is never shorter than `first_deadline_s`.

Many ranks (issue #30): rank 0's report of a new step is progress of every rank of the job
(`cover`: they were all in that step's collectives), recorded once, not per rank. A rank whose
beat says it waits inside a collective (`waiting`) is held up by a peer: when some ranks are stuck
and others are not waiting, `culprits()` names those only (the one that stalled among 16,384, not
the 16,383 that wait for it); when every stuck rank waits, a collective itself hangs and all are named.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from guard.core.heartbeat import BUSY_PHASES, PHASE_TRAIN, PHASES
from guard.core.tomlconf import check


@dataclass(kw_only=True, slots=True)
class ProgressConfig:
    safety_factor: float = 5.0
    floor_s: float = 60.0  # never call a rank stuck sooner than this
    first_deadline_s: float = 1800.0  # a phase never seen to complete, and a rank's start-up

    def __post_init__(self) -> None:
        check(self.safety_factor >= 1.0, "safety_factor", self.safety_factor, "must be >= 1")
        check(self.floor_s > 0, "floor_s", self.floor_s, "must be > 0")
        check(self.first_deadline_s > 0, "first_deadline_s", self.first_deadline_s, "must be > 0")


@dataclass(slots=True)
class RankProgress:
    step: int
    phase: str
    since_seen: float  # collector clock of the last progress
    since_sent: float  # trainer clock of the last progress
    last_sent: float  # trainer clock of the newest beat
    generation: int | None = None
    starting: bool = True  # no progress since this generation's first beat
    waiting: bool = False  # its last beat came from inside a collective (waiting for peers)
    beat_seen: float = 0.0  # collector clock of its last beat (progress or not)


@dataclass(slots=True)
class ProgressTracker:
    """Per run: learned phase durations and each rank's last progress."""

    cfg: ProgressConfig = field(default_factory=ProgressConfig)
    longest: dict[str, float] = field(default_factory=dict)  # phase -> longest completed duration
    ranks: dict[int, RankProgress] = field(default_factory=dict)
    covered: RankProgress | None = None  # rank 0's proof of every rank's progress (see `cover`)
    world: int = 0

    def beat(
        self,
        rank: int,
        now: float,
        step: int,
        phase: str = PHASE_TRAIN,
        sent: float | None = None,
        generation: int | None = None,
        waiting: bool = False,
    ) -> None:
        """A beat of `rank` that arrived at `now`, made at `sent` (trainer clock); `waiting`: made
        while the rank waited inside a collective."""
        if phase not in PHASES:
            raise ValueError(f"phase {phase!r} not one of {PHASES}")
        sent = now if sent is None or not math.isfinite(sent) else sent
        rp = self.ranks.get(rank)
        if rp is None or (
            generation is not None and rp.generation is not None and generation > rp.generation
        ):
            self.ranks[rank] = RankProgress(
                step=step,
                phase=phase,
                since_seen=now,
                since_sent=sent,
                last_sent=sent,
                generation=generation,
                waiting=waiting,
                beat_seen=now,
            )
            return
        if (
            generation is not None and rp.generation is not None and generation < rp.generation
        ) or sent <= rp.last_sent:
            return  # an older writer's or a replayed beat: no news about progress
        rp.waiting, rp.beat_seen = waiting, max(rp.beat_seen, now)
        # under rank 0's proof a rank's own beats come every `every` seconds, many steps apart:
        # their intervals are the beat interval, not a phase's duration (the proof teaches those)
        learn = self.covered is None or rank >= self.world
        self._advance(rp, now, step, phase, sent, generation, learn)

    def cover(
        self, world: int, now: float, step: int, phase: str = PHASE_TRAIN, sent: float | None = None
    ) -> None:
        """Rank 0's beat in a `world`-rank job; a new step is progress of every rank."""
        sent = now if sent is None or not math.isfinite(sent) else sent
        self.world = max(self.world, world)
        cv = self.covered
        if cv is None:
            self.covered = RankProgress(
                step=step, phase=phase, since_seen=now, since_sent=sent, last_sent=sent
            )
        elif step < cv.step and sent > cv.last_sent:  # a resume: counting starts again from its step
            self.covered = RankProgress(
                step=step, phase=phase, since_seen=now, since_sent=sent, last_sent=sent
            )
        elif sent > cv.last_sent:
            self._advance(cv, now, step, phase, sent, None)

    def _advance(
        self,
        rp: RankProgress,
        now: float,
        step: int,
        phase: str,
        sent: float,
        generation: int | None,
        learn: bool = True,
    ) -> None:
        rp.last_sent = sent
        if rp.generation is None:
            rp.generation = generation
        if step > rp.step or phase != rp.phase:
            if learn and not rp.starting:
                self.longest[rp.phase] = max(self.longest.get(rp.phase, 0.0), sent - rp.since_sent)
            rp.starting = False
            rp.step, rp.phase = max(rp.step, step), phase
            rp.since_seen, rp.since_sent = now, sent

    def end(self, rank: int | None = None) -> None:
        """Stop watching `rank` (every rank, and the proof, if None); learned durations stay."""
        if rank is None:
            self.ranks.clear()
            self.covered, self.world = None, 0
        else:
            self.ranks.pop(rank, None)

    def effective(self, rank: int) -> RankProgress | None:
        """The rank's own progress where it knows more than rank 0's proof (a later step, or a
        quiet phase at the proof's step: a checkpoint), else the proof (ranks < world). A rank's
        first beat is no progress of its own: 16,384 ranks first beat over a minute."""
        rp, cv = self.ranks.get(rank), self.covered
        if cv is None or rank >= self.world:
            return rp
        if rp is None or rp.step < cv.step:
            return cv
        if rp.step > cv.step or (rp.phase not in BUSY_PHASES and rp.since_seen > cv.since_seen):
            return rp
        return cv

    def free_since_stall(self) -> list[int] | None:
        """Ranks whose beat since the job's last progress (past the grace) says they do not wait
        in a collective; None without rank 0's proof."""
        if self.covered is None:
            return None
        since = self.covered.since_seen + self._grace()
        return [r for r, p in self.ranks.items() if p.beat_seen > since and not p.waiting]

    def _grace(self) -> float:
        # a beat within the first steps after the job's last progress may come from a rank still
        # computing before it blocks in the next collective: it says nothing about the stall
        return max(2.0, 2.0 * self.longest.get(PHASE_TRAIN, 0.0))

    def culprits(self, stuck: list[int]) -> list[int]:
        """Of the stuck ranks, the ones to name. First choice: those whose beat since the job last
        advanced says they are not waiting in a collective (a stalled rank beats early to say
        so: guard/runtime/export_sender.py); a rank that has not beaten since cannot be judged
        (16,384 ranks beat once a minute). None free: a collective hangs and all are named.
        Without rank 0's proof (one rank, an older trainer): those whose last beat does not wait."""
        ranks = self.ranks
        if self.covered is None:  # no proof: each rank's own last word
            own = [r for r in stuck if not (r in ranks and ranks[r].waiting)]
            return own or stuck
        since = self.covered.since_seen + self._grace()
        known = [r for r in stuck if r in ranks and ranks[r].beat_seen > since and not ranks[r].waiting]
        return known or stuck  # none free: a collective itself hangs, every rank waits

    def phase_deadline(self, phase: str) -> float:
        """Seconds without progress after which a rank in `phase` is stuck."""
        longest = self.longest.get(phase)
        if longest is None:
            return self.cfg.first_deadline_s
        return max(self.cfg.floor_s, self.cfg.safety_factor * longest)

    def deadline(self, rank: int) -> float:
        rp = self.effective(rank)
        if rp is None:
            return self.cfg.first_deadline_s
        d = self.phase_deadline(rp.phase)
        return max(d, self.cfg.first_deadline_s) if rp.starting else d

    def age(self, rank: int, now: float) -> float:
        """Seconds since `rank` last advanced (collector clock)."""
        rp = self.effective(rank)
        return math.nan if rp is None else max(0.0, now - rp.since_seen)

    def stalled(self, rank: int, now: float) -> bool:
        """True when `rank` has not advanced within its deadline (heartbeat not considered)."""
        return self.age(rank, now) > self.deadline(rank)

    # ---- persistence (the collector's state.json) ----------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "longest": dict(self.longest),
            "ranks": {
                str(r): [p.step, p.phase, p.since_seen, p.since_sent, p.last_sent, p.generation, p.starting]
                for r, p in self.ranks.items()
            },
        }

    def load_state_dict(self, st: dict[str, Any]) -> None:
        """Restore; raises ValueError/TypeError/KeyError on a state this code did not write."""
        longest = {PHASES[PHASES.index(k)]: float(v) for k, v in st.get("longest", {}).items()}
        ranks = {}
        for r, (step, phase, seen, since_sent, last_sent, gen, starting) in st.get("ranks", {}).items():
            ranks[int(r)] = RankProgress(
                step=int(step),
                phase=PHASES[PHASES.index(phase)],
                since_seen=float(seen),
                since_sent=float(since_sent),
                last_sent=float(last_sent),
                generation=None if gen is None else int(gen),
                starting=bool(starting),
            )
        self.longest, self.ranks = longest, ranks
