"""Operator commands of one run (POST /v1/runs/{run}/commands): kept in
runs/<run>/.collector/commands.json, handed to each rank until it acknowledges them."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from guard.store.layout import atomic_write_bytes


class CommandLog:
    """The run's commands (ids 1, 2, ...) and each rank's highest acknowledged id."""

    def __init__(
        self, path: Path, commands: list[dict[str, Any]], acks: dict[int, int] | None = None
    ) -> None:
        self.path = path
        self.commands = commands
        self.acks = acks or {}

    def pending(self, rank: int, after: int | None) -> list[dict[str, Any]]:
        """Commands for `rank` (or every rank) with an id above `after` (default: its ack)."""
        after = self.acks.get(rank, -1) if after is None else after
        return [c for c in self.commands if c["id"] > after and c.get("rank") in (None, rank)]

    def is_new_ack(self, rank: int, ack: int | None) -> bool:
        return ack is not None and ack > self.acks.get(rank, -1)

    def ack(self, rank: int, ack: int | None) -> None:
        if ack is not None:
            self.acks[rank] = max(self.acks.get(rank, -1), ack)

    def add(self, action: str, reason: str, rank: int | None) -> dict[str, Any]:
        """Append a command, durably (the file is replaced atomically) before it is handed out."""
        cmd = {
            "id": max((c["id"] for c in self.commands), default=0) + 1,
            "action": action,
            "reason": reason,
            "rank": rank,
            "time": time.time(),
        }
        cmds = [*self.commands, cmd]
        atomic_write_bytes(self.path, json.dumps(cmds).encode())
        self.commands = cmds
        return cmd
