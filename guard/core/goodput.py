"""Goodput: productive step time / wall time of the run, and where the rest went (badput).

Follows Google's ml-goodput-measurement split. Wall time runs from the run's first start to now,
across restarts (the time between a crash and the resumed process counts: the job was not
training). Badput buckets:

    startup_s      process start -> first step (imports, model build, checkpoint load)
    data_wait_s    steps waiting for the input pipeline
    checkpoint_s   writing checkpoints
    skipped_s      compute of steps whose update the guard skipped (or halted on)
    nonfinite_s    compute of steps whose update was applied with a non-finite loss or gradient
                   (guard off or observing): NaN weights learn nothing, so this is never goodput
    rolled_back_s  compute of applied steps later undone by a rollback
    restarts_s     checkpoint -> resumed process start: progress lost after the last checkpoint,
                   plus the time the job was down
    other_s        the remainder (telemetry hand-off, logging, progress bar, rounding)

Pure bookkeeping: callers pass durations; `report(now)` gives the dict kept in meta.json["goodput"].
"""

from __future__ import annotations

from typing import Any

# Said once: `moeguard train --help`, its end-of-run summary and the README use these words.
DEFINITION = (
    "goodput = productive step time / wall time since the run's first start: the share of the run "
    "spent computing updates that were applied and kept (badput: start-up, data wait, checkpoints, "
    "steps the guard skipped, non-finite or rolled-back steps, restarts)"
)

KEYS = (
    "productive_s",
    "data_wait_s",
    "checkpoint_s",
    "skipped_s",
    "nonfinite_s",
    "rolled_back_s",
    "startup_s",
    "restarts_s",
)


class Goodput:
    def __init__(self, started_at: float) -> None:
        self.started_at = started_at  # the run's first start (unix seconds); survives restarts
        self.split: dict[str, float] = dict.fromkeys(KEYS, 0.0)
        # productive compute since each held snapshot: lost (badput) if we roll back to it
        self.since_snapshot: dict[int, float] = {}

    def __getitem__(self, key: str) -> float:
        return self.split[key]

    def add(self, key: str, seconds: float) -> None:
        self.split[key] += seconds

    def step(self, applied: bool, step_time_s: float, data_wait_s: float, finite: bool = True) -> None:
        """`finite`: the step's loss and gradient were finite (an applied non-finite step is badput)."""
        compute = max(0.0, step_time_s - data_wait_s)
        self.split["data_wait_s"] += data_wait_s
        if applied and not finite:
            self.split["nonfinite_s"] += compute
        elif applied:
            self.split["productive_s"] += compute
            for s in self.since_snapshot:
                self.since_snapshot[s] += compute
        else:
            self.split["skipped_s"] += compute

    def snapshot_taken(self, step: int, held: set[int]) -> None:
        self.since_snapshot = {k: v for k, v in self.since_snapshot.items() if k in held}
        self.since_snapshot[step] = 0.0

    def rolled_back(self, restored: int) -> None:
        lost = self.since_snapshot.get(restored, 0.0)
        self.split["rolled_back_s"] += lost
        self.split["productive_s"] -= lost
        self.since_snapshot = {k: v for k, v in self.since_snapshot.items() if k <= restored}
        self.since_snapshot[restored] = 0.0

    def resumed(self, checkpoint_time: float, process_start: float) -> None:
        self.split["restarts_s"] += max(0.0, process_start - checkpoint_time)

    def report(self, now: float) -> dict[str, float]:
        wall = max(1e-9, now - self.started_at)
        other = wall - sum(self.split.values())
        return {"goodput": self.split["productive_s"] / wall, "wall_s": wall, **self.split, "other_s": other}

    def state_dict(self) -> dict[str, Any]:
        return {"started_at": self.started_at, "split": dict(self.split)}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.started_at = float(d.get("started_at", self.started_at))
        self.split.update({k: float(v) for k, v in d.get("split", {}).items() if k in self.split})
        self.since_snapshot = {}
