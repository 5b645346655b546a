"""How the app shows a run's status: the words, the badge colour and icon, what it means, and
how loud the Run health page says it. The statuses are guard/core/schema.py's RUN_STATUSES
(meta.json "status", written by trainer/outcome.py; "stale" derived in runs.py); meta.json
"status_note" says in words what happened to this run. Pure: no streamlit.

Only "finished" is green: a run that ran to the end with non-finite weights
(finished_nonfinite) is red, like a crash, because its weights are as unusable.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from guard.core import schema

Level = Literal["none", "info", "warning", "error"]  # how the Run health page says it


@dataclass(frozen=True, slots=True)
class StatusStyle:
    label: str  # the words shown (tables, badges, counts)
    icon: str  # a Streamlit material icon
    color: str  # a Streamlit theme colour: badges and the runs table's status pills
    level: Level
    meaning: str  # one sentence: what it means and what to do


STATUS_STYLES: dict[str, StatusStyle] = {
    schema.STATUS_RUNNING: StatusStyle("running", ":material/play_circle:", "blue", "none", "still training"),
    schema.STATUS_FINISHED: StatusStyle(
        "finished", ":material/check_circle:", "green", "none", "ran to its last step with finite loss"
    ),
    schema.STATUS_FINISHED_NONFINITE: StatusStyle(
        "finished, non-finite",
        ":material/dangerous:",
        "red",
        "error",
        "ran to its last step, but its loss or gradients ended non-finite: the final weights are not "
        "usable; rerun from a checkpoint before it went non-finite, with the guard on",
    ),
    schema.STATUS_HALTED: StatusStyle(
        "halted",
        ":material/pan_tool:",
        "red",
        "error",
        "the guard (or an operator) stopped it and saved a checkpoint; look at the halt event, then "
        "continue with --resume",
    ),
    schema.STATUS_CRASHED: StatusStyle(
        "crashed", ":material/error:", "red", "error", "an exception stopped it; meta.json says which"
    ),
    schema.STATUS_PREEMPTED: StatusStyle(
        "preempted",
        ":material/pause_circle:",
        "violet",
        "info",
        "SIGTERM (a scheduler's preemption) stopped it at a step boundary with a checkpoint; "
        "--resume continues it",
    ),
    schema.STATUS_INTERRUPTED: StatusStyle(
        "interrupted",
        ":material/cancel:",
        "orange",
        "warning",
        "Ctrl-C stopped it where it was, without a new checkpoint; --resume continues from the newest one",
    ),
    schema.STATUS_PEER_LOST: StatusStyle(
        "peer lost",
        ":material/link_off:",
        "red",
        "error",
        "a peer rank died (killed, OOM, its node lost) and this run stopped because of it; the "
        "HeartbeatLost page names the rank; relaunch to resume from the newest checkpoint",
    ),
    schema.STATUS_STALE: StatusStyle(
        "stale",
        ":material/schedule:",
        "yellow",
        "warning",
        "marked running, but nothing was written for a while: the trainer may have died without a word",
    ),
}


def style(status: str) -> StatusStyle:
    """The status's style; a status this app does not know (a newer writer) in grey, as it is."""
    known = STATUS_STYLES.get(status)
    if known is not None:
        return known
    return StatusStyle(status, ":material/help:", "gray", "info", f"status {status!r}: unknown to this app")


def label(status: str) -> str:
    return style(status).label


def status_note(meta: Mapping[str, Any]) -> str:
    """meta.json's "status_note" (what happened, in the trainer's words), "" when it has none."""
    note = meta.get("status_note")
    return note.strip() if isinstance(note, str) else ""
