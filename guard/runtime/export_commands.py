"""Operator commands on the exporter's side: fetched in the background (ingest answers and a
periodic GET, guard/runtime/export_link.py), handed to the trainer once by `take()`, and the
highest id handed over acknowledged in every later batch (guard/runtime/export_batch.py)."""

from __future__ import annotations

import threading
from typing import Any


class CommandInbox:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: list[dict[str, Any]] = []
        self._handed = -1  # highest command id handed to take()'s caller
        self._fetched = -1  # highest command id fetched

    @property
    def fetched(self) -> int:
        """The highest id fetched (-1: none): a GET asks for the commands after it."""
        return self._fetched

    @property
    def acknowledged(self) -> int:
        """The highest id handed to the trainer (-1: none yet)."""
        return self._handed

    def offer(self, answer: Any) -> None:
        """Keep the new commands of a collector answer ({"commands": [...]}); anything that is
        not a command record with an id above the last one fetched is ignored."""
        try:
            cmds = answer.get("commands") or []
        except AttributeError:
            return
        with self._lock:
            for c in cmds:
                if isinstance(c, dict) and isinstance(c.get("id"), int) and c["id"] > self._fetched:
                    self._waiting.append(c)
                    self._fetched = c["id"]

    def take(self) -> list[dict[str, Any]]:
        """Commands that arrived since the last call (no network call)."""
        with self._lock:
            out, self._waiting = self._waiting, []
            if out:
                self._handed = max(self._handed, max(c["id"] for c in out))
            return out
