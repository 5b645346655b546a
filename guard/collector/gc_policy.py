"""Short full garbage collections in a collector that holds thousands of connections.

A collector serving a big job holds ~45 long-lived objects per open rank connection (socket,
transport, protocol, keep-alive timer, ...): ~385k at 8,192 ranks. CPython's full (generation 2)
collection scans every one of them, and it runs every few seconds under the steady request churn:
measured on one core, 150-280 ms each, during which no request is answered (rank 0's ack p99
went from ~6 ms to 175-210 ms; bench/scale/rank_scale.py, docs/BENCHMARKS.md).

After each full collection the survivors are frozen (`gc.freeze()`: CPython's own tool for a
long-lived heap, moved out of the scanned generations), so the next one scans only what is new:
10-20 ms at the same load. Frozen objects are still freed by reference counting when they die;
only a reference cycle that dies frozen waits, so every `sweep_every_s` the frozen set is handed
back (`gc.unfreeze()`) and the next full collection scans, and frees, everything once.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

# one long pause this often, instead of one every few seconds; bounds what a cycle that died
# frozen holds to this much of the collector's life
SWEEP_EVERY_S = 600.0


class FreezeSurvivors:
    """A `gc.callbacks` entry: freeze after each full collection, unfreeze every `sweep_every_s`.
    It acts in the "stop" phase, when the collection is over and no other can start (CPython holds
    its `collecting` flag through the callbacks)."""

    def __init__(
        self, sweep_every_s: float = SWEEP_EVERY_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not sweep_every_s > 0:
            raise ValueError(f"sweep_every_s {sweep_every_s!r}: must be > 0")
        self.sweep_every_s = sweep_every_s
        self.clock = clock
        self.swept_at = clock()
        self.freezes = 0
        self.sweeps = 0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase != "stop" or info.get("generation") != 2:
            return
        now = self.clock()
        if now - self.swept_at >= self.sweep_every_s:
            self.swept_at = now
            self.sweeps += 1
            gc.unfreeze()  # the next full collection scans everything once
        else:
            self.freezes += 1
            gc.freeze()

    def install(self) -> FreezeSurvivors:
        if self not in gc.callbacks:
            gc.callbacks.append(self)
        return self

    def uninstall(self) -> None:
        """Stop freezing and hand the frozen objects back to the collector."""
        while self in gc.callbacks:
            gc.callbacks.remove(self)
        gc.unfreeze()
