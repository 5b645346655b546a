"""Host utilisation beside the steps: a sampler thread of its own reads the training process's CPU
and memory, the host's memory and (with a CUDA device) the GPU's utilisation and memory, and hands
a row to the run store's `host` table (schema.HOST_COLUMNS).

Why a thread of its own and not the step: a sample reads /proc and asks the driver, which must not
sit on the step's path; the run store's writer wakes only at a flush (every 50 steps) and the
heartbeat thread exists only with a collector. The sampler sleeps between samples, takes one at
most every `every_s` (MOEGUARD_HOST_EVERY_S, default 1 s; 0 turns it off) and only when a step
finished since the last one, tagged with that step: the training thread's whole share is one
integer store per step (`note_step`). Measured cost: docs/BENCHMARKS.md, "Host sampling".
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from guard.core import schema

log = logging.getLogger("moeguard.host")
DEFAULT_EVERY_S = 1.0


def every_s_from_env() -> float:
    """Seconds between samples from $MOEGUARD_HOST_EVERY_S (default 1; 0 or less: no sampling)."""
    raw = os.environ.get(schema.ENV_HOST_EVERY, "")
    try:
        return float(raw) if raw.strip() else DEFAULT_EVERY_S
    except ValueError:
        log.warning(
            "%s=%r is not a number of seconds: sampling every %s s",
            schema.ENV_HOST_EVERY,
            raw,
            DEFAULT_EVERY_S,
        )
        return DEFAULT_EVERY_S


def _meminfo() -> tuple[int | None, int | None]:
    """(used, total) bytes of the host's memory from /proc/meminfo, or (None, None)."""
    try:
        with open("/proc/meminfo", "rb") as f:
            kv = {ln.split(b":")[0]: int(ln.split()[1]) * 1024 for ln in f if ln.split()[1:2]}
        total, avail = kv[b"MemTotal"], kv[b"MemAvailable"]
        return total - avail, total
    except (OSError, KeyError, ValueError, IndexError):
        return None, None


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss() -> int | None:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


class HostSampler:
    """Samples the host into `sink(row)` from a daemon thread until close()."""

    def __init__(self, sink: Any, *, every_s: float = DEFAULT_EVERY_S) -> None:
        self.sink = sink
        self.every_s = every_s
        self._step: int | None = None  # the last step finished (set by the training thread)
        self._sampled: int | None = None
        self._stop = threading.Event()
        self._cpu0, self._wall0 = time.process_time(), time.monotonic()
        self._cuda = self._cuda_device()
        self._gpu_util_ok = self._cuda is not None
        self._thread = threading.Thread(target=self._run, name="moeguard-host", daemon=True)
        self._thread.start()

    @staticmethod
    def _cuda_device() -> int | None:
        """The training thread's CUDA device, when torch has one in use (never initialises CUDA)."""
        try:
            import torch

            if torch.cuda.is_available() and torch.cuda.is_initialized():
                return torch.cuda.current_device()
        except Exception:  # a broken driver must not stop training
            pass
        return None

    def note_step(self, step: int) -> None:
        """The training thread finished `step` (one attribute store: nothing else on its path)."""
        self._step = step

    def sample(self) -> dict[str, Any] | None:
        """One row now, or None when no step finished since the last one."""
        step = self._step
        if step is None or step == self._sampled:
            return None
        cpu, wall = time.process_time(), time.monotonic()
        dt = wall - self._wall0
        cpu_pct = 100.0 * (cpu - self._cpu0) / dt if dt > 0 else float("nan")
        self._cpu0, self._wall0, self._sampled = cpu, wall, step
        used, total = _meminfo()
        row = {
            "step": step,
            "time": time.time(),
            "cpu_pct": cpu_pct,
            "rss_bytes": _rss(),
            "host_mem_used_bytes": used,
            "host_mem_total_bytes": total,
            "gpu_util_pct": None,
            "gpu_mem_used_bytes": None,
        }
        if self._cuda is not None:
            row.update(self._gpu())
        return row

    def _gpu(self) -> dict[str, Any]:
        import torch

        out: dict[str, Any] = {}
        try:
            free, total = torch.cuda.mem_get_info(self._cuda)
            out["gpu_mem_used_bytes"] = int(total - free)
        except Exception:
            pass
        if self._gpu_util_ok:
            try:  # needs pynvml (or amdsmi): without it, memory only, asked once
                out["gpu_util_pct"] = float(torch.cuda.utilization(self._cuda))
            except Exception:
                self._gpu_util_ok = False
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                row = self.sample()
                if row is not None:
                    self.sink(row)
            except Exception:  # never raised into training; one line, then on
                log.exception("host sample failed")

    def close(self) -> None:
        """Take a last sample (the run's final steps) and stop the thread."""
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            row = self.sample()
            if row is not None:
                self.sink(row)
        except Exception:
            log.exception("host sample failed")


def start(sink: Any) -> HostSampler | None:
    """A sampler into `sink(row)` (guard/runtime/record.py: the run store and the exporter), or
    None when $MOEGUARD_HOST_EVERY_S turns it off."""
    every = every_s_from_env()
    return HostSampler(sink, every_s=every) if every > 0 else None
