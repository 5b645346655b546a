"""Small Streamlit helpers shared by the pages (messages, labels, run picking)."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

import polars as pl
import streamlit as st

from dashboards.data import config, runs
from dashboards.data import status as run_status
from guard.core import schema
from guard.store.reader import list_runs

# What every table cell, metric and label shows where there is no value (not measured, not
# applicable, no peak): one rendering on every page, never "None" or "nan".
NO_VALUE = "—"

# tokens/s (and MFU) is taken over one of three windows; wherever a figure is shown, it says which
# (issue #40). The Runs table and Run health's metrics read the recent past, Compare the steady
# state of each run, `moeguard train`'s progress line the step just run.
TPS_RECENT = "median of the last 100 steps"
TPS_STEADY = (
    "steady state: the median over steps after warm-up (the first 10%, at least 20 steps) whose update "
    "the guard applied"
)


def dataframe(data: pl.DataFrame, **kwargs: Any) -> Any:
    """st.dataframe with the app's one "no value" rendering: a null shows as NO_VALUE (Streamlit's
    own placeholder is the word "None"), and a NaN in a float column is a null first (a median of
    no finite values, a run with no peak), so it shows as NO_VALUE too, not "NaN"."""
    floats = [c for c, t in data.schema.items() if t.is_float()]
    if floats:
        data = data.with_columns(pl.col(floats).fill_nan(None))
    return st.dataframe(data, placeholder=NO_VALUE, **kwargs)


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
    present = list(statuses)
    options = list(dict.fromkeys([*schema.RUN_STATUSES, *present]))
    meanings = "\n".join(f"- **{run_status.label(s)}**: {run_status.style(s).meaning}" for s in options)
    return st.column_config.MultiselectColumn(
        "status",
        options=options,
        color=[run_status.style(s).color for s in options],
        format_func=run_status.label,
        width=pill_width(run_status.label(s) for s in present),
        help="How the run ended, or that it still runs (the note says more):\n" + meanings,
    )


def pill_width(labels: Iterable[str]) -> int:
    """Pixels for a table column of status pills that fits the longest label shown (a fixed 150
    gave "finished" the width of "finished, non-finite" and pushed the Runs table off screen):
    the pill's ~5.6 px per character of its 12 px font, its padding and the cell's."""
    return round(24 + 5.6 * max((len(label) for label in labels), default=8))


def text_width(texts: Iterable[str], *, least: int = 60) -> int:
    """Pixels for a table column that shows the longest of `texts` whole (~6.6 px a character of
    the table's 14 px font, and the cell's padding); a column left to size itself measures only
    some rows, and clipped the longest run id."""
    return max(least, round(20 + 6.6 * max((len(t) for t in texts), default=0)))


def same_in_every_row(df: pl.DataFrame, columns: Iterable[str]) -> dict[str, str]:
    """{column: its one value} for each of `columns` that holds one value, the same in every row
    (no null), in a table of two rows or more: a table says such a value once, above it, instead
    of spending a column on it (the Runs table did not fit at 1,600 px)."""
    if df.height < 2:
        return {}
    return {
        c: str(df[c][0])
        for c in columns
        if c in df.columns and df[c].null_count() == 0 and df[c].n_unique() == 1 and str(df[c][0]) != ""
    }


def clip(text: str, limit: int) -> str:
    """`text` cut to at most `limit` characters at a word boundary, "…" marking the cut ("" stays
    ""): a sentence shortened to fit a table cell, its full text shown beside the table."""
    if len(text) <= limit:
        return text
    head = text[: limit - 1]
    cut = head.rsplit(" ", 1)[0] if " " in head[limit // 2 :] else head
    return cut.rstrip(" ,;:") + "…"


def status_counts(statuses: Iterable[str]) -> str:
    """Markdown: one badge per status present ("4 finished"), in RUN_STATUSES order (unknown
    ones last), coloured as in the tables."""
    n = Counter(statuses)
    order = [s for s in schema.RUN_STATUSES if n[s]] + sorted(set(n) - set(schema.RUN_STATUSES))
    looks = {s: run_status.style(s) for s in order}
    return " ".join(f":{looks[s].color}-badge[{looks[s].icon} {n[s]} {looks[s].label}]" for s in order)


NOTE_CELL_CHARS = 16  # the Runs table's note cell; longer notes are clipped there, in full below it


def run_note(info: runs.RunInfo) -> str:
    """What happened to the run (its status_note) and what the app cannot show of it, in one line."""
    return "; ".join(n for n in (info.status_note, info.note) if n)


def endings(infos: Iterable[runs.RunInfo], limit: int = 10) -> str:
    """Markdown: one line per run whose status needs a word (not running or finished) or whose
    note is too long for the Runs table's note cell, newest first, `limit` at most: its badge,
    its id, and its note in full (else what the status means)."""
    lines = []
    todo = [
        i for i in infos if run_status.style(i.status).level != "none" or len(run_note(i)) > NOTE_CELL_CHARS
    ]
    for i in todo[:limit]:
        s = run_status.style(i.status)
        lines.append(f"- :{s.color}-badge[{s.icon} {s.label}] `{i.run_id}`: {run_note(i) or s.meaning}")
    if len(todo) > limit:
        lines.append(
            f"- and {len(todo) - limit} more: the status column above, the note on each run's health page"
        )
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
        return NO_VALUE
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


def show_damaged(run_id: str, damaged: list[tuple[str, str]], limit: int = 5) -> None:
    """A warning naming each part file the reader skipped (guard/store/reader.py), with why."""
    if not damaged:
        return
    lines = [f"- `{p}`: {why}" for p, why in damaged[:limit]]
    if len(damaged) > limit:
        lines.append(f"- and {len(damaged) - limit} more")
    st.warning(
        f"Run `{run_id}`: {len(damaged)} damaged part file(s) skipped; the rest of the run is shown "
        "without their rows. Move or delete them (a crash, a full disk or a copy in progress leaves "
        "such files):\n" + "\n".join(lines),
        icon=":material/broken_image:",
    )


def runs_or_stop(cfg: config.AppConfig) -> list[runs.RunInfo]:
    """All runs under the configured folder, or a clear message and st.stop()."""
    if not cfg.runs_dir.is_dir():
        st.warning(
            f"The run folder `{cfg.runs_dir}` does not exist. Start the app with "
            "`moeguard app --runs DIR`, where DIR holds one folder per run (runs/<run_id>/meta.json)."
        )
        st.stop()
    infos = runs.discover(cfg.runs_dir, stale_after_s=stale_after())
    mine, canary = runs.split_canary(infos)
    # new canaries keep their workers' runs apart, under RUNS/canary-runs/; older ones wrote beside
    # the user's runs (meta.json "canary"). The sidebar toggle shows both kinds, the former named
    # canary-runs/<run> (a run id there may repeat one of the user's)
    workers_dir = cfg.runs_dir / runs.WORKER_RUNS_DIR
    n_workers = len(list_runs(workers_dir)) if workers_dir.is_dir() else 0
    if st.session_state.get("show_canary", False):
        if n_workers:
            apart = [
                dataclasses.replace(i, run_id=f"{runs.WORKER_RUNS_DIR}/{i.run_id}")
                for i in runs.discover(workers_dir, stale_after_s=stale_after())
            ]
            infos = sorted([*infos, *apart], key=lambda r: -(r.updated_at or 0.0))
    elif mine and (canary or n_workers):
        infos = mine  # a store of canary runs only (RUNS/canary-runs) shows them all
        st.caption(
            f"{len(canary) + n_workers} canary worker run(s) hidden; the sidebar's *Show canary worker runs* "
            "lists them."
        )
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
