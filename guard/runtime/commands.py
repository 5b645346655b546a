"""Where a guarded loop's operator commands come from (guard/core/commands.py merges them).

A CommandSource hands over the commands that arrived since the last call, as the collector
records them ({"id": int, "action": "skip|rollback|halt", "reason": str}). Two exist:
guard.runtime.exporter.Exporter (commands posted to the collector, fetched in the background)
and CommandFile, for a loop with no collector: an operator writes a JSON list of commands, in
the collector's own commands.json format, to a file the loop watches, e.g.

    echo '[{"id": 1, "action": "skip", "reason": "bad shard"}]' > runs/my-run/commands.json
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)


class CommandSource(Protocol):
    def poll_commands(self) -> list[dict[str, Any]]:
        """Commands that arrived since the last call (cheap: called once per step)."""
        ...


class CommandFile:
    """Operator commands from a JSON file (a list of command records), read again only when the
    file changes; each id is handed over once. A file that does not parse is logged and skipped
    until it changes again (a half-written file must not stop training)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._seen_id = 0
        self._stamp: tuple[int, int] | None = None  # (mtime_ns, size) of the last read

    def poll_commands(self) -> list[dict[str, Any]]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return []
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return []
        self._stamp = stamp
        try:
            cmds = json.loads(self.path.read_text())
            new = [c for c in cmds if int(c["id"]) > self._seen_id and isinstance(c["action"], str)]
        except (OSError, ValueError, TypeError, KeyError) as e:
            log.warning("operator commands in %s not read: %s", self.path, e)
            return []
        new.sort(key=lambda c: int(c["id"]))
        if new:
            self._seen_id = int(new[-1]["id"])
        return new
