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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from guard.core.heartbeat import PHASE_TRAIN, PHASES
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


@dataclass(slots=True)
class ProgressTracker:
    """Per run: learned phase durations and each rank's last progress."""

    cfg: ProgressConfig = field(default_factory=ProgressConfig)
    longest: dict[str, float] = field(default_factory=dict)  # phase -> longest completed duration
    ranks: dict[int, RankProgress] = field(default_factory=dict)

    def beat(
        self,
        rank: int,
        now: float,
        step: int,
        phase: str = PHASE_TRAIN,
        sent: float | None = None,
        generation: int | None = None,
    ) -> None:
        """A beat of `rank` that arrived at `now`, made at `sent` (trainer clock)."""
        if phase not in PHASES:
            raise ValueError(f"phase {phase!r} not one of {PHASES}")
        sent = now if sent is None or not math.isfinite(sent) else sent
        rp = self.ranks.get(rank)
        if rp is None or (
            generation is not None and rp.generation is not None and generation > rp.generation
        ):
            self.ranks[rank] = RankProgress(
                step=step, phase=phase, since_seen=now, since_sent=sent, last_sent=sent, generation=generation
            )
            return
        if (
            generation is not None and rp.generation is not None and generation < rp.generation
        ) or sent <= rp.last_sent:
            return  # an older writer's or a replayed beat: no news about progress
        rp.last_sent = sent
        if rp.generation is None:
            rp.generation = generation
        if step > rp.step or phase != rp.phase:
            if not rp.starting:
                self.longest[rp.phase] = max(self.longest.get(rp.phase, 0.0), sent - rp.since_sent)
            rp.starting = False
            rp.step, rp.phase = max(rp.step, step), phase
            rp.since_seen, rp.since_sent = now, sent

    def end(self, rank: int | None = None) -> None:
        """Stop watching `rank` (every rank if None); learned durations stay."""
        if rank is None:
            self.ranks.clear()
        else:
            self.ranks.pop(rank, None)

    def phase_deadline(self, phase: str) -> float:
        """Seconds without progress after which a rank in `phase` is stuck."""
        longest = self.longest.get(phase)
        if longest is None:
            return self.cfg.first_deadline_s
        return max(self.cfg.floor_s, self.cfg.safety_factor * longest)

    def deadline(self, rank: int) -> float:
        rp = self.ranks.get(rank)
        if rp is None:
            return self.cfg.first_deadline_s
        d = self.phase_deadline(rp.phase)
        return max(d, self.cfg.first_deadline_s) if rp.starting else d

    def age(self, rank: int, now: float) -> float:
        """Seconds since `rank` last advanced (collector clock)."""
        rp = self.ranks.get(rank)
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
