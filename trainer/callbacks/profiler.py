"""torch.profiler over a window of steps (`telemetry.profile`, rank 0, guarded runs only): a
TensorBoard trace in runs/<id>/profile/ that `moeguard canary` summarises and the app links.

The schedule counts steps from the start of run(): `profile_wait` steps skipped, then
`profile_warmup`, then `profile_active` recorded, once.

The trace (3.5 MB for the default window) is written only when its disk has MIN_FREE_BYTES to
spare: on a nearly full disk it was what filled it (issue #40); checkpoints and the run store
come first. Skipped, it says so on stderr.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

from guard.core.report import StepReport
from guard.store.full import free_bytes, size_text
from trainer.callbacks.callback import Callback

MIN_FREE_BYTES = 1 << 30  # below this much free space on its disk, no trace is written


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
            on_trace_ready=self._write_trace(tensorboard_trace_handler(str(self.trace_dir))),
        )
        self.prof.start()

    def _write_trace(self, write: Any) -> Any:
        """torch's trace handler, run only when the disk has room to spare."""

        def ready(prof: Any) -> None:
            free = free_bytes(self.trace_dir)
            if free is not None and free < MIN_FREE_BYTES:
                print(
                    f"moeguard train: warning: profiler trace skipped: {size_text(free)} free on the disk "
                    f"of {self.trace_dir} (a trace is written with at least {size_text(MIN_FREE_BYTES)} "
                    "to spare: checkpoints and the run store need the room)",
                    file=sys.stderr,
                )
                return
            write(prof)

        return ready

    def post_step(self, step: int, report: StepReport) -> None:
        if self.prof is not None:
            self.prof.step()

    def close(self) -> None:
        if self.prof is not None:
            self.prof.stop()
            self.prof = None
