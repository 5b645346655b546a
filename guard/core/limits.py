"""The collector's resource limits: what one run, one batch and the whole service may hold.

Two kinds, never a silent truncation:
  * per request (a batch, a report): over the limit, the batch is refused whole with 400, the
    message naming the limit, its value and the batch's value (`LimitExceeded`), and counted in
    moeguard_collector_limit_refusals_total{limit}; nothing of it is stored.
  * accumulated (series of one run on /metrics): past `max_series_per_run` the lowest-priority
    series of that run are left out of the scrape and counted in
    moeguard_collector_series_dropped{run} (run-level series first, then ranks, then layers).

Flags of `moeguard collector` and their defaults:

    --max-hot-runs 1000          runs held in full in memory (LRU beyond: checkpointed, evicted)
    --max-ranks 16384            rank ids must be below this
    --max-layers 1024            layer ids per report, and the largest layer id + 1
    --max-detectors 64           distinct detector names per run
    --max-series-per-run 100000  /metrics series per run (the rest dropped and counted)
    --max-body-bytes 8 MiB       request bodies on every endpoint (413, read no further;
                                 guard/wire/http_limits.py)

Runs in memory: at most `max_hot_runs` runs keep their full state (write-ahead log, pending rows,
detectors, the last report, the expert-share histograms); the least recently used beyond that
are checkpointed and evicted, keeping a compact record (halt latch, heartbeats, counters, last
step scalars) so alerts keep working, and reload from disk on their next request.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# CLI flag -> field, for the error messages (a user sets the flag, not the field)
FLAGS = {
    "max_hot_runs": "--max-hot-runs",
    "max_ranks": "--max-ranks",
    "max_layers": "--max-layers",
    "max_detectors": "--max-detectors",
    "max_series_per_run": "--max-series-per-run",
}


@dataclass(kw_only=True, slots=True)
class CollectorLimits:
    """Documented defaults sized for a 16k-GPU run of a 1k-layer model, with room to spare."""

    max_hot_runs: int = 1000  # runs with full state in memory; LRU beyond are evicted (state on disk)
    max_ranks: int = 16384  # rank ids must be < this (so at most this many ranks per run)
    max_layers: int = 1024  # layer ids per report, and every layer id must be < this
    max_detectors: int = 64  # distinct detector names per run (verdict counters / series)
    max_series_per_run: int = 100_000  # /metrics series of one run; the rest dropped and counted

    def __post_init__(self) -> None:
        for name in FLAGS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"limits.{name} = {v!r}: must be an integer >= 1")


class LimitExceeded(ValueError):
    """A batch over one of the limits; `limit` is its field name, `value` what the batch had."""

    def __init__(self, where: str, limit: str, value: int, maximum: int) -> None:
        super().__init__(
            f"{where}: {value} is over the limit {limit} = {maximum} "
            f"(collector flag {FLAGS.get(limit, limit)})"
        )
        self.limit, self.value, self.maximum = limit, value, maximum


def check_rank(rank: int, limits: CollectorLimits) -> None:
    if rank >= limits.max_ranks:
        raise LimitExceeded("field 'rank'", "max_ranks", rank, limits.max_ranks - 1)


def check_report(raw: dict[str, Any], where: str, limits: CollectorLimits) -> None:
    """Layer ids of one report, checked on the raw JSON before any array is built."""
    for key in ("layer_ids_L", "moe_layer_ids_M"):
        ids = raw.get(key)
        if not isinstance(ids, list):
            continue  # absent or malformed: StepReport.from_json names it
        if len(ids) > limits.max_layers:
            raise LimitExceeded(f"{where}.{key}: layer ids", "max_layers", len(ids), limits.max_layers)
        top = max((i for i in ids if isinstance(i, int) and not isinstance(i, bool)), default=-1)
        if top >= limits.max_layers:
            raise LimitExceeded(f"{where}.{key}: layer id", "max_layers", top, limits.max_layers - 1)


def check_detectors(known: Iterable[str], new: Iterable[str], limits: CollectorLimits) -> None:
    """Distinct detector names a run would have after this batch."""
    names = set(known)
    names.update(new)
    if len(names) > limits.max_detectors:
        raise LimitExceeded(
            "events[].detector: distinct detector names of the run",
            "max_detectors",
            len(names),
            limits.max_detectors,
        )
