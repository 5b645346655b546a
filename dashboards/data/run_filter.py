"""The Runs page's filters: name substring, status, tag and started-at date, applied to the runs'
meta.json (already read to list them, dashboards/data/runs.py), so filtering 1,000 runs reads no
table and no extra file. A run written before tags existed has none; one without a start time
(meta.json only, or damaged) passes a date filter only when the filter is unset. Pure: no streamlit.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass, field

from dashboards.data.runs import RunInfo
from guard.core.tags import run_tags


@dataclass(frozen=True, slots=True)
class RunFilter:
    name: str = ""  # substring of the run id, case-insensitive
    statuses: frozenset[str] = field(default_factory=frozenset)  # empty: any status
    tags: frozenset[str] = field(default_factory=frozenset)  # empty: any; else a run with ANY of them
    since: dt.date | None = None  # started on or after (local date)
    until: dt.date | None = None  # started on or before

    @property
    def active(self) -> bool:
        return bool(self.name.strip() or self.statuses or self.tags or self.since or self.until)


def started_at(info: RunInfo) -> float | None:
    """meta.json "started_at" (unix seconds), or None."""
    v = info.meta.get("started_at")
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def started_date(info: RunInfo) -> dt.date | None:
    t = started_at(info)
    return None if t is None else dt.datetime.fromtimestamp(t).date()


def keep(info: RunInfo, f: RunFilter) -> bool:
    if f.name.strip() and f.name.strip().lower() not in info.run_id.lower():
        return False
    if f.statuses and info.status not in f.statuses:
        return False
    if f.tags and not f.tags.intersection(run_tags(info.meta)):
        return False
    if f.since is not None or f.until is not None:
        day = started_date(info)
        if day is None:
            return False
        if (f.since is not None and day < f.since) or (f.until is not None and day > f.until):
            return False
    return True


def apply(infos: Iterable[RunInfo], f: RunFilter) -> list[RunInfo]:
    """The runs that pass every filter, in their order."""
    return [i for i in infos if keep(i, f)]


def all_tags(infos: Iterable[RunInfo]) -> list[str]:
    """Every tag any run has, sorted (the tag filter's choices)."""
    return sorted({t for i in infos for t in run_tags(i.meta)})


def date_span(infos: Iterable[RunInfo]) -> tuple[dt.date, dt.date] | None:
    """The first and last start date of the runs (the date filter's default range), or None."""
    days = [d for i in infos if (d := started_date(i)) is not None]
    return (min(days), max(days)) if days else None
