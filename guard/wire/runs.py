"""`GET /v1/runs`: the collector's run listing, one type for the collector (which writes it) and
the app (which reads it, dashboards/data/open_alerts.py).

    {"runs": [RunListing.to_json(), ...]}

    run          the run id
    status       running | finished | halted | stale (every rank's heartbeat lost) | crashed
    last_step    the last rank-0 step the collector has (null when none)
    ranks        {"<rank>": RankListing}: last report time and step, phase, heartbeat age /
                 timeout / lost, progress age / deadline, stuck (guard/core/progress.py),
                 waiting; a job of more than 64 ranks lists only its ranks out of line (lost,
                 late, stuck, or beating outside rank 0's per-step proof of the others)
    hot          true while the collector holds the run in full in memory (not evicted)
    quarantined  only for a run the collector refused to load: why (its files are damaged)

Non-finite numbers are written as null. Readers ignore keys they do not know (a newer
collector may send more) and skip entries without a run id.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from guard.core import schema

# The alerts (alerts/moeguard.rules.yml) a listing entry says are firing, or about to.
ALERT_HALTED, ALERT_LOST, ALERT_STUCK, ALERT_QUARANTINED = (
    "RunHalted",
    "HeartbeatLost",
    "RunStuck",
    "RunQuarantined",
)


@dataclass(kw_only=True, slots=True)
class RankListing:
    last_report_time: float | None = None
    last_step: int | None = None
    phase: str | None = None
    age_s: float | None = None
    timeout_s: float | None = None
    lost: bool = False
    progress_age_s: float | None = None
    progress_deadline_s: float | None = None
    stuck: bool = False
    waiting: bool = False  # its last beat came from inside a collective (held up by a peer)


@dataclass(kw_only=True, slots=True)
class RunListing:
    run: str
    status: str = schema.STATUS_RUNNING
    last_step: int | None = None
    ranks: dict[int, RankListing] = field(default_factory=dict)
    hot: bool = False
    quarantined: str | None = None  # why the collector refused to load it

    def open_alerts(self) -> list[str]:
        """The moeguard alerts this entry implies, one per (alert, label set) as Alertmanager
        would hold them: RunHalted, HeartbeatLost per lost rank, RunStuck per stuck rank,
        RunQuarantined."""
        out = [ALERT_QUARANTINED] if self.quarantined is not None else []
        if self.status == schema.STATUS_HALTED:
            out.append(ALERT_HALTED)
        out += [ALERT_LOST for r in self.ranks.values() if r.lost]
        out += [ALERT_STUCK for r in self.ranks.values() if r.stuck]
        return out

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "run": self.run,
            "status": self.status,
            "last_step": self.last_step,
            "ranks": {str(k): _finite(asdict(v)) for k, v in sorted(self.ranks.items())},
            "hot": self.hot,
        }
        if self.quarantined is not None:
            d["quarantined"] = self.quarantined
        return d

    @classmethod
    def from_json(cls, d: Any) -> RunListing | None:
        """An entry as the collector wrote it; None for one without a run id. Unknown keys and
        ill-typed optional fields are ignored (a reader must not fail on a newer collector)."""
        if not isinstance(d, dict) or not isinstance(d.get("run"), str) or not d["run"]:
            return None
        ranks: dict[int, RankListing] = {}
        raw_ranks = d.get("ranks")
        for k, v in raw_ranks.items() if isinstance(raw_ranks, dict) else ():
            if isinstance(v, dict) and str(k).isdigit():
                ranks[int(k)] = RankListing(**{f: v[f] for f in RankListing.__slots__ if f in v})  # type: ignore[attr-defined]
        last = d.get("last_step")
        why = d.get("quarantined")
        return cls(
            run=d["run"],
            status=str(d.get("status") or schema.STATUS_RUNNING),
            last_step=last if isinstance(last, int) and not isinstance(last, bool) else None,
            ranks=ranks,
            hot=d.get("hot") is True,
            quarantined=str(why) if why is not None else None,
        )


def runs_body(listings: list[RunListing]) -> dict[str, Any]:
    """The /v1/runs answer."""
    return {"runs": [r.to_json() for r in listings]}


def parse_runs(body: Any) -> list[RunListing]:
    """The entries of a /v1/runs answer (a {"runs": [...]} object, or a bare list); ValueError
    when it is neither."""
    runs = body.get("runs") if isinstance(body, dict) else body
    if not isinstance(runs, list):
        raise ValueError(f"expected {{'runs': [...]}}, got {type(body).__name__}")
    return [r for r in map(RunListing.from_json, runs) if r is not None]


def _finite(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}
