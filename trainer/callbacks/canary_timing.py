"""The canary's step timing (trainer/canary_worker.py): each step's thread CPU time and wall time,
a paired reference measurement after it, and an optional injected slowdown.

    pre_step       start the step's clocks
    post_backward  `--inject slow:PCT`: burn PCT% of the previous step's CPU time (CPU timing), or
                   sleep PCT% of its wall time (GPU), inside the step, so the run store's
                   step_time_s includes it, like a kernel that got slower
    post_step      one sample: CPU and wall time less the injected part's own cost for the next
                   step's base, then `reference()`'s time (the machine's yardstick, CPU timing only)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from guard.core.report import StepReport
from trainer.callbacks.callback import Callback


def burn_cpu(seconds: float) -> None:
    """Busy work for `seconds` of this thread's CPU time (a kernel that got slower)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class CanaryTiming(Callback):
    name = "canary_timing"

    def __init__(self, *, slow_pct: float = 0.0) -> None:
        self.slow_pct = slow_pct
        self.reference: Callable[[], float] | None = None  # set for CPU timing: seconds of a fixed workload
        self.samples: list[dict[str, Any]] = []
        self._c0 = self._w0 = 0.0
        self._burned_cpu = self._slept = 0.0
        self._last_cpu: float | None = None
        self._last_wall: float | None = None

    def pre_step(self, step: int) -> None:
        self._burned_cpu = self._slept = 0.0
        self._c0, self._w0 = time.thread_time(), time.perf_counter()

    def post_backward(self, step: int) -> None:
        if self.slow_pct <= 0:
            return
        frac = self.slow_pct / 100
        device = self.trainer.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            base = self._last_wall if self._last_wall is not None else time.perf_counter() - self._w0
            self._slept = base * frac
            time.sleep(self._slept)
        else:
            base = self._last_cpu if self._last_cpu is not None else time.thread_time() - self._c0
            self._burned_cpu = base * frac
            burn_cpu(self._burned_cpu)

    def post_step(self, step: int, report: StepReport) -> None:
        cpu = time.thread_time() - self._c0
        ref = self.reference() if self.reference is not None else float("nan")
        self._last_cpu, self._last_wall = cpu - self._burned_cpu, report.step_time_s - self._slept
        self.samples.append(
            {
                "step": report.step,
                "action": report.action,
                "tokens": report.tokens,
                "cpu_s": cpu,
                "ref_cpu_s": ref,
                "step_time_s": report.step_time_s,
                "data_wait_s": report.data_wait_s,
                "mfu": report.mfu,
                "tokens_per_s": report.tokens_per_s,
                "mem_peak_bytes": report.mem_peak_bytes,
                "loss": report.loss,
            }
        )
