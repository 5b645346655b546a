"""Small Streamlit helpers shared by the pages (messages, labels, run picking)."""

from __future__ import annotations

import time

import streamlit as st

from dashboards.data import config, runs
from guard.core import schema

# status -> (material icon, badge colour). Plain words in tables: emoji fonts are not a given.
STATUS_STYLE: dict[str, tuple[str, str]] = {
    schema.STATUS_RUNNING: (":material/play_circle:", "blue"),
    schema.STATUS_FINISHED: (":material/check_circle:", "green"),
    schema.STATUS_HALTED: (":material/pan_tool:", "red"),
    schema.STATUS_CRASHED: (":material/error:", "red"),
    schema.STATUS_STALE: (":material/schedule:", "orange"),
}


def status_badge(status: str, help: str | None = None) -> None:
    icon, color = STATUS_STYLE.get(status, (None, "gray"))
    st.badge(status, icon=icon, color=color, help=help)  # type: ignore[arg-type]


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
