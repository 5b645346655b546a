"""The incident book: per incident, the desired status (firing while any member fires) and, per
sink, the status last delivered there. Thread-safe; with a path, every change is durable (see
guard/pager/journal.py) before the call that made it returns, so a restart neither re-pages nor
forgets a resolve."""

from __future__ import annotations

import copy
import math
import threading
from pathlib import Path
from typing import Any

from guard.pager.intake import FIRING, ORIGIN_ALERTMANAGER, ORIGIN_EVENT, RESOLVED, Update
from guard.pager.journal import COMPACT_IDLE_S, Incidents, StateFile, apply_op

PRUNE_AFTER_S = 86400.0  # resolved, delivered incidents are forgotten after a day


class IncidentBook:
    """Incidents by dedup_key; every change goes through journal.apply_op, so the state file
    replays to exactly this."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._incidents: Incidents = {}
        self._state = StateFile(path) if path is not None else None
        if self._state is not None:
            try:
                self._incidents = self._state.load()
            except (OSError, ValueError) as e:
                raise SystemExit(f"moeguard pager: cannot read state file {path}: {e}") from None
            with self._lock:
                self._state.compact(self._incidents)

    def apply(self, updates: list[Update], now: float) -> list[str]:
        """Record member news; returns the keys whose desired status may have changed."""
        touched: list[str] = []
        with self._lock:
            for u in updates:
                inc = self._incidents.get(u.key)
                if inc is None:
                    if u.status == RESOLVED:
                        continue  # never saw it firing: nothing to resolve
                    inc = self._incidents[u.key] = new_incident(u, now)
                apply_update(inc, u, now)
                if u.key not in touched:
                    touched.append(u.key)
            self._log_locked([["put", k, self._incidents[k]] for k in touched])
        return touched

    def expire_events(self, now: float) -> int:
        """Forget event-only incidents past their TTL. No resolve is sent: an event says a run
        needs a human, never that it is fine again, so the page stays open until one closes it.
        Resolved incidents delivered everywhere are forgotten PRUNE_AFTER_S after their change."""
        with self._lock:
            stale = [k for k, inc in self._incidents.items() if events_expired(inc, now)]
            done = [
                k
                for k, inc in self._incidents.items()
                if inc["status"] == RESOLVED
                and FIRING not in inc["sent"].values()
                and now - inc["updated"] > PRUNE_AFTER_S
            ]
            ops: list[list[Any]] = [["del", k] for k in stale + done]
            for op in ops:
                apply_op(self._incidents, op)
            self._log_locked(ops)
        return len(stale)

    def snapshot(self, key: str) -> dict[str, Any] | None:
        with self._lock:
            inc = self._incidents.get(key)
            return copy.deepcopy(inc) if inc is not None else None

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._incidents)

    def record(self, key: str, sink: str, status: str | None, error: str | None) -> bool:
        """After a delivery attempt: `status` delivered (or None on failure). Returns whether
        the incident still differs from what `sink` has (its status changed meanwhile)."""
        with self._lock:
            inc = self._incidents.get(key)
            if inc is None:
                return False
            op = ["sent", key, sink, status, None if status is not None else error]
            apply_op(self._incidents, op)
            self._log_locked([op])
            return status is not None and inc["status"] != status

    def stats(self) -> dict[str, int]:
        with self._lock:
            firing = sum(inc["status"] == FIRING for inc in self._incidents.values())
            failing = sum(bool(inc["errors"]) for inc in self._incidents.values())
            return {"incidents": len(self._incidents), "firing": firing, "failing": failing}

    def compact_if_idle(self, idle_s: float = COMPACT_IDLE_S) -> bool:
        """Fold the journal into the snapshot once the book has been idle (journal.StateFile)."""
        with self._lock:
            return self._state is not None and self._state.compact_if_idle(self._incidents, idle_s)

    def checkpoint(self) -> None:
        """Fold the journal into the snapshot now (a clean stop leaves one current file)."""
        with self._lock:
            if self._state is not None:
                self._state.checkpoint(self._incidents)

    def _log_locked(self, ops: list[list[Any]]) -> None:
        if self._state is not None:
            self._state.append(ops, self._incidents)


def new_incident(u: Update, now: float) -> dict[str, Any]:
    return {
        "key": u.key,
        "identity": u.identity,
        "status": RESOLVED,
        "members": {},
        "sent": {},
        "errors": {},
        "created": now,
    }


def apply_update(inc: dict[str, Any], u: Update, now: float) -> None:
    """One member's news -> the incident's members and desired status."""
    if u.origin == ORIGIN_ALERTMANAGER:
        # Alertmanager knows this incident now; it, not the event TTL, ends it.
        inc["members"] = {m: v for m, v in inc["members"].items() if v["origin"] != ORIGIN_EVENT}
    if u.status == FIRING:
        inc["members"][u.member] = {
            "origin": u.origin,
            "labels": u.labels,
            "expires": u.details.get("expires"),
        }
        inc.update(
            labels=u.labels,
            annotations=u.annotations,
            origin=u.origin,
            starts_at=u.starts_at,
            generator_url=u.generator_url,
            external_url=u.external_url,
            event=u.details.get("event"),
        )
    else:
        inc["members"].pop(u.member, None)
    inc["status"] = FIRING if inc["members"] else RESOLVED
    inc["updated"] = now


def events_expired(inc: dict[str, Any], now: float) -> bool:
    """Every member is a guard event past its TTL (Alertmanager members never expire this way)."""
    return bool(inc["members"]) and all(
        m["origin"] == ORIGIN_EVENT and (m["expires"] or math.inf) < now for m in inc["members"].values()
    )


def delivery_needed(inc: dict[str, Any], sent: str | None) -> str | None:
    """The status to deliver to a sink that last got `sent`, or None if it is up to date.
    A sink that never heard of a firing incident gets no resolve."""
    if inc["status"] == FIRING and sent != FIRING:
        return FIRING
    if inc["status"] == RESOLVED and sent == FIRING:
        return RESOLVED
    return None
