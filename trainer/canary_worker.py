"""The canary's measuring worker: one short training run of the canary config, timed step by step.

    python -m trainer.canary_worker SPEC.json OUT.json

guard/canary/measure.py starts it (fresh process, stable memory layout) and reads OUT: the
per-step samples, the environment and the hardware class. Everything that runs the model lives
here, in trainer/; guard only reads the result (guard never imports trainer).

On CPU each step is timed in the main thread's CPU time and followed by a fixed numpy reference
matmul timed the same way, so MFU's peak is measured in the same process, interleaved with the
very steps it normalises (guard/canary/cli.py's help says why, with the measurements).
The timing itself is a trainer callback (trainer/callbacks/canary_timing.py); this module runs
the trainer with it and writes what it measured.
"""

from __future__ import annotations

import gc

if __name__ == "__main__":  # a worker process: no GC through its imports (measure_in_process)
    gc.disable()

import hashlib
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

from guard.canary.config import TIMING_CPU, TIMING_WALL, load_setup
from guard.canary.reference import Reference
from guard.core import schema
from guard.store.layout import atomic_write_json
from guard.store.reader import read_meta
from trainer.callbacks.canary_timing import CanaryTiming
from trainer.canary_cli import TRAINER
from trainer.envinfo import hardware_key
from trainer.loop import Trainer


def hardware_id(env: dict[str, Any]) -> str:
    """The hardware class a baseline is valid for: device model; on CPU the microarchitecture
    (vendor/family/model/stepping, L2 size, a hash of the ISA flags), logical CPUs and memory;
    torch threads, world size, dtype. Software (torch, CUDA) is deliberately not in
    it: a torch upgrade is exactly the regression the canary must compare across."""
    if env.get("device_type") != "cpu":
        return hardware_key(env)
    info: dict[str, str] = {}
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            k, _, v = line.partition(":")
            k, v = k.strip(), v.strip()
            if (
                k in ("vendor_id", "cpu family", "model", "stepping", "model name", "cache size")
                and k not in info
            ):
                info[k] = v
            elif k == "flags" and not flags:
                flags = v
    except OSError:
        pass
    cpu = info.get("model name") or platform.processor() or platform.machine()
    arch = "/".join(info.get(k, "?") for k in ("vendor_id", "cpu family", "model", "stepping"))
    fl = hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:6] if flags else "noflags"
    cache = info.get("cache size", "?").replace(" ", "")
    return f"{cpu} ({arch} L2:{cache} flags:{fl}) x{os.cpu_count()}cpu {_mem_gib()}GiB|{hardware_key(env)}"


def _mem_gib() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20)
    except (OSError, ValueError, IndexError):
        pass
    return 0


def measure_in_process(spec: dict[str, Any]) -> dict[str, Any]:
    """One measurement, in this process. Returns per-step samples and the environment."""
    setup = load_setup(spec["config"], spec.get("overrides"), TRAINER)
    cfg = setup.train_config(spec.get("variant"))
    cfg.name = spec["name"]
    if not cfg.train.gc_every:  # CPython's automatic GC for the run, as configured; otherwise the
        gc.enable()  # run's StepGC freezes what the worker's imports left, unscanned
    run_dir = Path(spec["run_dir"])
    timer = CanaryTiming(slow_pct=float(spec.get("slow_pct", 0.0)))
    try:
        trainer = Trainer(cfg, run_dir, progress=False, callbacks=[timer])
    except ValueError as e:  # a forced kernel or device this build cannot run (ConfigError too)
        return {"status": "unavailable", "reason": str(e)}
    timing = setup.canary.timing
    if timing == "auto":
        timing = TIMING_CPU if trainer.device.type == "cpu" else TIMING_WALL
    reference = Reference() if timing == TIMING_CPU else None
    timer.reference = reference
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    code = trainer.run()
    wall = time.perf_counter() - t0
    out = {
        "status": "ok" if code == 0 else "error",
        "reason": "" if code == 0 else f"the guard halted the run (exit {code})",
        "run_dir": str(run_dir),
        "run_id": run_dir.name,
        "timing": timing,
        "env": trainer.env,
        "hardware": hardware_id(trainer.env),
        "flops_per_token": trainer.flops_per_token,
        "reference_flops": reference.flops if reference is not None else None,
        "peak_flops": trainer.peak,
        "torch_threads": _torch_threads(),
        "wall_s": wall,
        "loadavg": [load0[0], os.getloadavg()[0]],
        "slow_pct": timer.slow_pct,
        "python_executable": sys.executable,
        "numpy": _numpy_version(),
        "aslr_off": _aslr_off(),
        "hash_seed": os.environ.get("PYTHONHASHSEED"),
        "samples": timer.samples,
    }
    _annotate_run(run_dir, spec, out)
    return out


def _numpy_version() -> str:
    return np.__version__


def _aslr_off() -> bool | None:
    try:
        return bool(int(Path("/proc/self/personality").read_text(), 16) & 0x0040000)
    except (OSError, ValueError):
        return None


def _torch_threads() -> int:
    return torch.get_num_threads()


def _annotate_run(run_dir: Path, spec: dict[str, Any], out: dict[str, Any]) -> None:
    """Mark the run store entry as a canary run (meta.json) and keep its samples (canary.json)."""
    meta = read_meta(run_dir)
    if meta is not None:
        meta["canary"] = {
            "variant": spec.get("variant_label", ""),
            "slow_pct": out["slow_pct"],
            "timing": out["timing"],
            "attempt": spec.get("attempt", 1),
        }
        atomic_write_json(run_dir / schema.META_FILE, meta)
    atomic_write_json(run_dir / "canary.json", {k: v for k, v in out.items() if k != "env"})


def _worker_main(argv: list[str]) -> int:
    spec_path, out_path = Path(argv[0]), Path(argv[1])
    spec = json.loads(spec_path.read_text())
    try:
        result = measure_in_process(spec)
    except Exception as e:  # reported to the parent with its type; the traceback goes to stderr
        traceback.print_exc()
        result = {"status": "error", "reason": f"{type(e).__name__}: {e}"}
    tmp = out_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, default=str))
    os.replace(tmp, out_path)


if __name__ == "__main__":
    raise SystemExit(_worker_main(sys.argv[1:]))
