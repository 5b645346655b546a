"""Small Streamlit helpers shared by the pages (messages, labels, run picking)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

import streamlit as st

from dashboards.data import config, runs
from dashboards.data import status as run_status
from guard.core import schema


def status_badge(status: str, help: str | None = None) -> None:
    s = run_status.style(status)
    st.badge(s.label, icon=s.icon, color=s.color, help=help or s.meaning)  # type: ignore[arg-type]


def status_cell(status: str) -> list[str]:
    """A table cell for `status_column()`: the status as a one-pill list."""
    return [status]


def status_column(statuses: Iterable[str]) -> Any:
    """A read-only table column that shows each status as a pill in its badge colour, in words
    (plain words, not emoji: emoji fonts are not a given), wide enough for the longest; its
    help says what each status means. `statuses`: those in the table."""
    options = list(dict.fromkeys([*schema.RUN_STATUSES, *statuses]))
    meanings = "\n".join(f"- **{run_status.label(s)}**: {run_status.style(s).meaning}" for s in options)
    return st.column_config.MultiselectColumn(
        "status",
        options=options,
        color=[run_status.style(s).color for s in options],
        format_func=run_status.label,
        width=150,
        help="How the run ended, or that it still runs (the note says more):\n" + meanings,
    )


def status_counts(statuses: Iterable[str]) -> str:
    """Markdown: one badge per status present ("4 finished"), in RUN_STATUSES order (unknown
    ones last), coloured as in the tables."""
    n = Counter(statuses)
    order = [s for s in schema.RUN_STATUSES if n[s]] + sorted(set(n) - set(schema.RUN_STATUSES))
    looks = {s: run_status.style(s) for s in order}
    return " ".join(f":{looks[s].color}-badge[{looks[s].icon} {n[s]} {looks[s].label}]" for s in order)


def endings(infos: Iterable[runs.RunInfo], limit: int = 10) -> str:
    """Markdown: one line per run whose status needs a word (not running or finished), newest
    first, `limit` at most: its badge, its id, and its status_note (else what the status means)."""
    lines = []
    todo = [i for i in infos if run_status.style(i.status).level != "none"]
    for i in todo[:limit]:
        s = run_status.style(i.status)
        lines.append(f"- :{s.color}-badge[{s.icon} {s.label}] `{i.run_id}`: {i.status_note or s.meaning}")
    if len(todo) > limit:
        lines.append(f"- and {len(todo) - limit} more: the status and note columns above")
    return "\n".join(lines)


def table_height(rows: int, max_rows: int = 40) -> int:
    """Pixels for a st.dataframe that shows `rows` rows (up to `max_rows`) without scrolling."""
    return 38 + 35 * max(1, min(rows, max_rows))


def show_status(info: runs.RunInfo) -> None:
    """How the run ended, as loudly as it matters (nothing for running and finished without a
    note): what the status means, and the run's own status_note."""
    s = run_status.style(info.status)
    note = info.status_note
    if s.level == "none":
        if note:
            st.caption(f"Status note: {note}")
        return
    # the run's own note says it best (its words name the step and the checkpoint); the general
    # meaning where it has none
    text = f"**{s.label}**: {note or s.meaning}"
    {"info": st.info, "warning": st.warning, "error": st.error}[s.level](text, icon=s.icon)


def age(ts: float | None) -> str:
    if ts is None:
        return "—"
    s = max(0.0, time.time() - ts)
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= n:
            return f"{s / n:.0f} {unit} ago"
    return f"{s:.0f} s ago"


def stale_after() -> float:
    return float(st.session_state.get("stale_after_s", runs.DEFAULT_STALE_S))


def show_problem(info: runs.RunInfo) -> None:
    p = info.problem()
    if p is not None:
        level, msg = p
        (st.warning if level == "warning" else st.info)(msg)


def runs_or_stop(cfg: config.AppConfig) -> list[runs.RunInfo]:
    """All runs under the configured folder, or a clear message and st.stop()."""
    if not cfg.runs_dir.is_dir():
        st.warning(
            f"The run folder `{cfg.runs_dir}` does not exist. Start the app with "
            "`moeguard app --runs DIR`, where DIR holds one folder per run (runs/<run_id>/meta.json)."
        )
        st.stop()
    infos = runs.discover(cfg.runs_dir, stale_after_s=stale_after())
    if not infos:
        stray = runs.stray_folders(cfg.runs_dir)
        extra = (
            f" ({len(stray)} folder(s) without meta.json ignored: {', '.join(stray[:5])})" if stray else ""
        )
        st.info(
            f"No runs in `{cfg.runs_dir}` yet{extra}. A run shows up here as soon as "
            "`moeguard train --run-dir <folder>/<run_id>` writes its meta.json."
        )
        st.stop()
    return infos
