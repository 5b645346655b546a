"""torch.profiler over a window of steps (`telemetry.profile`, rank 0, guarded runs only): a
TensorBoard trace in runs/<id>/profile/ that `moeguard canary` summarises and the app links.

The schedule counts steps from the start of run(): `profile_wait` steps skipped, then
`profile_warmup`, then `profile_active` recorded, once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from guard.core.report import StepReport
from trainer.callbacks.callback import Callback


class Profiler(Callback):
    name = "profiler"

    def __init__(self, trace_dir: Path, device: torch.device, *, wait: int, warmup: int, active: int) -> None:
        self.trace_dir = trace_dir
        self.device = device
        self.wait, self.warmup, self.active = wait, warmup, active
        self.prof: Any = None

    def pre_train(self) -> None:
        # kineto prints "USDT: ... profiler_start/profiler_stop" (its level 5) to stderr, through the
        # progress bar; 6 silences it (and kineto's own errors: set KINETO_LOG_LEVEL=4 to see those).
        # Read when the profiler first starts, so setting it here is in time.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self.prof = profile(
            activities=acts,
            schedule=schedule(wait=self.wait, warmup=self.warmup, active=self.active, repeat=1),
            on_trace_ready=tensorboard_trace_handler(str(self.trace_dir)),
        )
        self.prof.start()

    def post_step(self, step: int, report: StepReport) -> None:
        if self.prof is not None:
            self.prof.step()

    def close(self) -> None:
        if self.prof is not None:
            self.prof.stop()
            self.prof = None
