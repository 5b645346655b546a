"""Run discovery: every run folder under the store, its status (stale derived here), its
run-store compatibility, and the signature that keys every cached loader.

`run_signature()` is the modification time of meta.json and of each table folder: a new part
file is an atomic rename into its table folder, which moves that folder's mtime, so a live run
refreshes on the next rerun and a finished one is read once (a look within a second of a write
is keyed apart: reader.settled). Pure: no streamlit."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dashboards.data import status as run_status
from guard.canary.ab_format import REPORT_DIR, WORKER_RUNS_DIR
from guard.core import schema
from guard.store import reader, summary
from guard.store.reader import list_runs, read_meta

DEFAULT_STALE_S = 300.0


COMPAT_OK = "ok"


COMPAT_OLDER = "older"


COMPAT_NEWER = "newer"


COMPAT_UNREADABLE = "unreadable"


@dataclass(frozen=True, slots=True)
class RunInfo:
    """What the app knows about a run before reading any table."""

    run_id: str  # the run folder's name (unique under the run store; meta.json may repeat it)
    path: str
    meta: dict[str, Any]
    status: str  # RUN_STATUSES, "stale" derived here
    compat: str  # COMPAT_*
    schema_version: int | None
    updated_at: float | None
    tables: dict[str, bool] = field(default_factory=dict)  # table -> has at least one part

    @property
    def env(self) -> dict[str, Any]:
        env = self.meta.get("env")
        return env if isinstance(env, dict) else {}

    @property
    def readable(self) -> bool:
        return self.compat in (COMPAT_OK, COMPAT_OLDER)

    @property
    def has_steps(self) -> bool:
        return self.tables.get(schema.TABLE_STEPS, False)

    @property
    def canary(self) -> bool:
        """A canary worker's run (meta.json "canary"), not one the user trained."""
        return isinstance(self.meta.get("canary"), dict)

    @property
    def status_note(self) -> str:
        """What happened to the run, in the trainer's words (meta.json "status_note"; "" if none)."""
        return run_status.status_note(self.meta)

    @property
    def note(self) -> str:
        """What the app cannot show of this run, in a few words ("" when all is well)."""
        if self.compat == COMPAT_UNREADABLE:
            return "meta.json unreadable"
        if self.compat == COMPAT_NEWER:
            return f"newer schema {self.schema_version}: upgrade moeguard"
        if not self.has_steps:
            return "no steps yet (meta.json only)"
        missing = [t for t in (schema.TABLE_LAYERS, schema.TABLE_EXPERTS) if not self.tables.get(t)]
        if self.compat == COMPAT_OLDER:
            return f"older schema {self.schema_version}"
        if missing:
            return "no " + "/".join(missing) + " table"
        return ""

    def problem(self) -> tuple[str, str] | None:
        """(level, message) for a run the app can only partly show; None when all is well."""
        if self.compat == COMPAT_UNREADABLE:
            return "warning", f"Run `{self.run_id}`: meta.json could not be parsed; its tables are not shown."
        if self.compat == COMPAT_NEWER:
            return "warning", (
                f"Run `{self.run_id}` was written by a newer moeguard (run-store schema "
                f"{self.schema_version}; this app reads up to {schema.SCHEMA_VERSION}). "
                "Upgrade moeguard to view it."
            )
        if not self.has_steps:
            return "info", (
                f"Run `{self.run_id}` has no steps on disk yet (meta.json only): the trainer writes "
                "its first chunk after `flush_every` steps, or it stopped before that."
            )
        if self.compat == COMPAT_OLDER:
            return "info", (
                f"Run `{self.run_id}` uses an older run-store schema ({self.schema_version}; current "
                f"{schema.SCHEMA_VERSION}). Columns added since are shown as empty."
            )
        return None


def run_signature(run_dir: str | Path) -> tuple[int, ...]:
    """Changes whenever the run gains a part file or rewrites meta.json (cache key): the mtimes
    of meta.json and of each table folder, then 1 while the newest of them is not yet `settled`
    (reader.RACY_NS), else 0. A load keyed while a folder could still change within its mtime's
    tick is keyed apart from the one made after, so a part renamed in that tick is read then."""
    mtimes = last_writes(run_dir)
    return (*mtimes, 0 if reader.settled(max(mtimes)) else 1)


def last_writes(run_dir: str | Path) -> tuple[int, ...]:
    """The mtimes (ns) of the run's meta.json and of each table folder (0: not there)."""
    base = os.fspath(run_dir) + os.sep
    sig = []
    for name in _SIGNED:
        try:
            sig.append(os.stat(base + name).st_mtime_ns)
        except OSError:
            sig.append(0)
    return tuple(sig)


_SIGNED = (schema.META_FILE, *schema.TABLES)


def run_info(
    run_dir: str | Path, *, stale_after_s: float = DEFAULT_STALE_S, now: float | None = None
) -> RunInfo:
    d = Path(run_dir)
    meta = read_meta(d)
    tables = run_tables(d)
    if meta is None or not isinstance(meta, dict):
        return RunInfo(
            run_id=d.name,
            path=str(d),
            meta={},
            status=schema.STATUS_CRASHED,
            compat=COMPAT_UNREADABLE,
            schema_version=None,
            updated_at=None,
            tables=tables,
        )
    try:
        version = int(meta.get("schema_version", 0))
    except (TypeError, ValueError):
        version = 0
    if version > schema.SCHEMA_VERSION:
        compat = COMPAT_NEWER
    elif version < schema.SCHEMA_VERSION:
        compat = COMPAT_OLDER
    else:
        compat = COMPAT_OK
    updated = meta.get("updated_at")
    updated = float(updated) if isinstance(updated, int | float) else None
    # the trainer may flush parts without touching meta.json: newest activity counts
    sig_s = max(last_writes(d)) / 1e9
    last_activity = max(updated or 0.0, sig_s) or None
    status = str(meta.get("status", schema.STATUS_RUNNING))
    now = time.time() if now is None else now
    if status == schema.STATUS_RUNNING and last_activity is not None and now - last_activity > stale_after_s:
        status = schema.STATUS_STALE
    return RunInfo(
        run_id=d.name,
        path=str(d),
        meta=meta,
        status=status,
        compat=compat,
        schema_version=version,
        updated_at=last_activity,
        tables=tables,
    )


def run_tables(run_dir: str | Path) -> dict[str, bool]:
    """table -> has at least one part: from summary.json's listing where it is current (no table
    folder listed: guard/store/summary.py PARTS_KEY), else each folder scanned up to its first part."""
    doc = summary.read_summary(run_dir)
    tails = summary.current_tails(doc, run_dir) if doc is not None else None
    if tails is not None:
        return {t: bool(tails[t]) for t in schema.TABLES}
    return {t: reader.has_part(run_dir, t) for t in schema.TABLES}


def discover(runs_dir: str | Path, *, stale_after_s: float = DEFAULT_STALE_S) -> list[RunInfo]:
    """Every run folder (one with meta.json) under `runs_dir`, newest activity first."""
    infos = [run_info(p, stale_after_s=stale_after_s) for p in list_runs(runs_dir)]
    return sorted(infos, key=lambda r: -(r.updated_at or 0.0))


def split_canary(infos: list[RunInfo]) -> tuple[list[RunInfo], list[RunInfo]]:
    """(the user's runs, canary workers' runs). Canary workers write to RUNS/canary-runs/; older
    canaries wrote beside the user's runs, and meta.json "canary" still tells them apart."""
    return [i for i in infos if not i.canary], [i for i in infos if i.canary]


# Folders moeguard itself keeps under a run store that are not runs: not "ignored" strays.
OWN_FOLDERS = (REPORT_DIR, WORKER_RUNS_DIR)


def stray_folders(runs_dir: str | Path) -> list[str]:
    """Folders under runs_dir that are not runs (no meta.json) nor moeguard's own (OWN_FOLDERS)."""
    d = Path(runs_dir)
    if not d.is_dir():
        return []
    runs = {p.name for p in list_runs(d)}
    return sorted(
        p.name
        for p in d.iterdir()
        if p.is_dir() and p.name not in runs and p.name not in OWN_FOLDERS and not p.name.startswith(".")
    )
