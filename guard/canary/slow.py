"""`--inject slow:PCT` inside a training command the canary did not write (guard/canary/own.py).

The canary exports MOEGUARD_CANARY_SLOW_PCT to the command of the side it slows, and GuardedStep
burns it inside every step() (so any command that trains with GuardedStep, MoEGuardCallback or the
torchtitan launcher is slowed without a change to it):

    burn = StepBurner.from_env()        # None unless the canary asked for a slowdown
    ...
    if burn: burn()                     # once per optimizer step

Each call burns PCT% of the step since the previous call ended (the previous burn excluded, so the
slowdown does not compound), as moeguard's own canary worker does: on a CPU the process's CPU time
(a busy loop until the process has spent PCT% more: on a shared or quota-throttled host a
wall-clock busy wait gets only a share of a core and would burn less than it claims; measured on
the 2-core box, a 10% wall-clock burn read as +0..3% CPU), on an accelerator wall time after a
device sync (`sync`, e.g. torch.cuda.synchronize). The run store's step times show it either way.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from guard.canary.keys import SLOW_ENV


class StepBurner:
    def __init__(self, pct: float, sync: Callable[[], None] | None = None) -> None:
        """`sync`: None burns CPU time; a device sync (called first) burns wall time."""
        if not 0 < pct <= 1000:
            raise ValueError(f"{SLOW_ENV} = {pct!r}: must be in (0, 1000]")
        self.frac, self.sync = pct / 100, sync
        self.clock = time.perf_counter if sync is not None else time.process_time
        self._end: float | None = None

    @classmethod
    def from_env(cls, sync: Callable[[], None] | None = None) -> StepBurner | None:
        """The slowdown the canary asked for in $MOEGUARD_CANARY_SLOW_PCT, or None."""
        raw = os.environ.get(SLOW_ENV, "").strip()
        if not raw:
            return None
        try:
            pct = float(raw)
        except ValueError:
            raise ValueError(f"{SLOW_ENV} = {raw!r}: expected a percentage in (0, 1000]") from None
        return cls(pct, sync)

    def __call__(self, skip: float = 0.0) -> None:
        """Burn; `skip`: seconds of this clock since the last burn that were not the step's work
        (the canary's yardstick), left out of the base."""
        if self.sync is not None:
            self.sync()
        now = self.clock()
        if self._end is not None:
            until = now + self.frac * max(0.0, now - self._end - skip)
            x = 0
            while self.clock() < until:
                x += 1  # a few ns of work per check: the loop itself is the burn
        self._end = self.clock()
