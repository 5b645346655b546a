"""The `[store]` TOML table: how a long run's store is kept (retention, rollups, compaction).

    [store]
    raw_window_steps = 10000    # every row of every table for the newest 10,000 steps
    incident_steps = 25         # and +-25 steps around every incident, forever
    ...

docs/long-runs.md explains each value and the sizing behind the defaults (a month of Trinity
Large, 1M steps x 58 MoE layers x 256 experts x 2,048 ranks, in under 10 GB per store). The
training job reads it from its config file (`[store]`), the collector from `--store-config`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from guard.core.tomlconf import check, from_dict, load_toml
from guard.store.layout import ROLLUP_RESOLUTIONS, SEGMENT_STEPS


@dataclass(kw_only=True, slots=True)
class StoreConfig:
    # Rollups (guard/store/rollup.py): layers, experts, groups and ranks rows of each closed
    # 1,000-step segment summarised per series at 10, 100 and 1,000 steps (mean, min, max, last).
    rollups: bool = True
    # Compaction (guard/store/compaction.py): a closed segment's parts merged into one per table.
    compact: bool = True
    # Raw (full-fidelity) layers/experts/groups/ranks rows kept for the newest this many steps;
    # older ones are dropped once their segment's rollups are durable, except around incidents.
    # 0: keep every raw row forever (no retention; the store grows ~118 KB a step at Trinity shape).
    raw_window_steps: int = 10_000
    # +- this many steps of raw rows kept around every incident (a verdict, an action, a
    # non-finite step, an injected fault, an operator command, a restart), never rolled away.
    incident_steps: int = 25
    # The raw steps all incidents' windows may keep in total. Past it a new incident keeps its own
    # step only (still full fidelity), so a detector that fires every step cannot fill the disk.
    incident_budget_steps: int = 20_000
    # Rollup rows kept for the newest this many steps per resolution (0: forever). Measured at
    # Trinity shape (bench/scale/store_tiers.py): r10 ~29 KB a step, r100 ~3.4 KB, r1000 ~0.37 KB.
    r10_window_steps: int = 50_000
    r100_window_steps: int = 0
    r1000_window_steps: int = 0
    # A segment is compacted and rolled up once the run is this many steps past its end (rows of
    # a late flush, or events logged a step late, land first).
    compact_lag_steps: int = 50
    # Parts a compaction replaced are deleted once the merged part is this old. 0: at once, so a
    # plain `scan_parquet("<table>/*.parquet")` never sees a row twice for more than an instant; a
    # guard/store reader that listed the folder just before lists it again (and a crash's
    # leftovers are hidden from it either way). > 0 trades that for readers that never re-list.
    grace_s: float = 0.0

    def __post_init__(self) -> None:
        for key in ("raw_window_steps", "r10_window_steps", "r100_window_steps", "r1000_window_steps"):
            v = getattr(self, key)
            check(
                v == 0 or v >= SEGMENT_STEPS, f"store.{key}", v, f"must be 0 (forever) or >= {SEGMENT_STEPS}"
            )
        check(self.incident_steps >= 0, "store.incident_steps", self.incident_steps, "must be >= 0")
        check(
            self.incident_budget_steps >= 0,
            "store.incident_budget_steps",
            self.incident_budget_steps,
            "must be >= 0",
        )
        check(
            0 <= self.compact_lag_steps < SEGMENT_STEPS,
            "store.compact_lag_steps",
            self.compact_lag_steps,
            f"must be in [0, {SEGMENT_STEPS})",
        )
        check(self.grace_s >= 0, "store.grace_s", self.grace_s, "must be >= 0")
        kept = [w or float("inf") for w in self.windows().values()]  # 0: forever
        check(
            kept == sorted(kept),
            "store.r10_window_steps",
            self.windows(),
            "each coarser resolution must be kept at least as long as a finer one (0 = forever)",
        )

    def windows(self) -> dict[int, int]:
        """Steps each rollup resolution is kept for (0: forever)."""
        w = {10: self.r10_window_steps, 100: self.r100_window_steps, 1000: self.r1000_window_steps}
        return {r: w[r] for r in ROLLUP_RESOLUTIONS}

    @property
    def retires_raw(self) -> bool:
        return self.rollups and self.raw_window_steps > 0


def load_store_config(path: str | Path | None = None, table: dict | None = None) -> StoreConfig:
    """From a TOML file (its `[store]` table, or the whole file if it has none) or a dict."""
    if path is not None:
        data = load_toml(path)
        table = data.get("store", data)
    return from_dict(StoreConfig, table or {}, prefix="store.")
