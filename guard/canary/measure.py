"""Measuring: worker processes, each a fresh short training run, pooled into one Measurement.

One measurement is a fixed short training run of the canary config in a fresh worker process
(clean peak-memory high-water mark, no compile caches or allocator state carried over), stored in
the run store like any run. The worker (`python -m trainer.canary_worker SPEC OUT`, named by
`Setup.trainer.worker`) runs the model; this side writes its spec, starts it with a stable
memory layout and reads its result. On CPU it runs torch on one thread and times each step in
thread CPU time against a numpy reference matmul (trainer/canary_worker.py says why).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from guard.canary.ab_format import WORKER_RUNS_DIR
from guard.canary.config import Setup, worker_overrides
from guard.canary.keys import MFU
from guard.canary.profile import profile_summary
from guard.canary.stats import pool_processes, profiled_steps, summarize


def stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def slug(text: str) -> str:
    keep = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in text)
    return "_".join(p for p in keep.split("_") if p)[:80]


def new_run_dir(runs: Path, name: str) -> Path:
    """A new folder for one canary worker run: RUNS/canary-runs/<name>[-n], apart from the
    user's runs in RUNS (guard/canary/ab_format.py WORKER_RUNS_DIR)."""
    runs = runs / WORKER_RUNS_DIR
    d = runs / name
    n = 1
    while d.exists():
        n += 1
        d = runs / f"{name}-{n}"
    return d


def progress(msg: str) -> None:
    print(f"canary: {msg}", file=sys.stderr, flush=True)


@dataclass(kw_only=True, slots=True)
class Measurement:
    """One measured run: the worker's result and its summary (None unless status == 'ok')."""

    result: dict[str, Any]
    summary: dict[str, Any] | None = None
    attempt: int = 1

    @property
    def ok(self) -> bool:
        return self.result.get("status") == "ok"


def measure(
    setup: Setup,
    runs: Path,
    *,
    name: str,
    variant: dict[str, Any] | None = None,
    variant_label: str = "",
    slow_pct: float = 0.0,
    attempt: int = 1,
) -> Measurement:
    """One measurement: `canary.processes` fresh worker processes in a row, pooled by median.

    Why several processes: on a CPU, most of the run-to-run spread is fixed per process (measured
    on 2 cores: the two halves of one run agree to r = 0.94 while runs differ by 2.5% sd), which is
    where its memory physically lands and so how its tensors share the caches. More steps in one
    process cannot average that away; more processes can (sd / sqrt(K), and the median drops an
    odd one). The first process's run keeps the profile the report summarises.
    """
    cfg = setup.train_config(variant)
    k = setup.canary.processes
    results: list[dict[str, Any]] = []
    started = stamp()
    for p in range(k):
        suffix = f"p{p + 1}" if k > 1 else ""
        run_dir = new_run_dir(runs, f"{slug(name)}-{started}-r{attempt}{suffix}")
        spec = worker_spec(
            setup,
            run_dir,
            name=name,
            variant=variant,
            variant_label=variant_label,
            slow_pct=slow_pct,
            attempt=attempt,
        )
        result = spawn_measurement(
            spec,
            setup.canary.timeout_s,
            cfg.train.threads,
            setup.canary.stable_layout,
            worker=setup.trainer.worker,
        )
        if result.get("status") != "ok":
            return Measurement(result=result, attempt=attempt)
        results.append(result)
        if k > 1:
            one = summarize(result, setup.canary.warmup_steps, profiled_steps(cfg))
            progress(f"  process {p + 1}/{k}: MFU p50 {100 * one[MFU]:.3f}% ({result['wall_s']:.0f} s)")
    summaries = [summarize(r, setup.canary.warmup_steps, profiled_steps(cfg)) for r in results]
    first, last = results[0], results[-1]
    merged = {
        **first,
        "wall_s": sum(r["wall_s"] for r in results),
        "loadavg": [first["loadavg"][0], last["loadavg"][1]],
        "run_ids": [r["run_id"] for r in results],
    }
    m = Measurement(result=merged, attempt=attempt)
    m.summary = pool_processes(summaries)
    m.summary["profile"] = profile_summary(Path(first["run_dir"]))
    return m


def worker_spec(
    setup: Setup,
    run_dir: Path,
    *,
    name: str,
    variant: dict[str, Any] | None = None,
    variant_label: str = "",
    slow_pct: float = 0.0,
    attempt: int = 1,
) -> dict[str, Any]:
    """What one worker process measures (the SPEC of `python -m trainer.canary_worker SPEC OUT`)."""
    return {
        "config": str(setup.path.resolve()),
        "overrides": worker_overrides(setup),
        "variant": variant or {},
        "variant_label": variant_label,
        "name": name,
        "run_dir": str(run_dir.resolve()),
        "slow_pct": slow_pct,
        "attempt": attempt,
    }


_PR_SET_PDEATHSIG = 1
_ADDR_NO_RANDOMIZE = 0x0040000


def _linux_worker_setup(stable_layout: bool) -> None:
    """preexec_fn of a worker on Linux: it dies with the canary (SIGTERM when the parent exits,
    killed or not: a stopped canary leaves no worker running on the cores the next measurement
    needs), and with stable_layout its address-space randomisation is off (personality flag)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if stable_layout:
            current = libc.personality(0xFFFFFFFF)
            if current != -1:
                libc.personality(current | _ADDR_NO_RANDOMIZE)
    except (OSError, AttributeError):
        pass


def spawn_measurement(
    spec: dict[str, Any],
    timeout_s: float,
    threads: int,
    stable_layout: bool = True,
    *,
    worker: tuple[str, ...],
    python: str | None = None,
    extra_env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> dict[str, Any]:
    """Run one measurement in a fresh worker process; never raises for a failed run.

    worker: the interpreter's arguments that start the worker (TrainerSide.worker), SPEC and OUT
    appended. python: the interpreter that runs it (default: this one); `--ab py:PATH` runs another
    venv's. extra_env and cwd decide which moeguard that interpreter imports (guard/canary/ab.py).

    stable_layout: where the heap, tensors and the interpreter land in memory (ASLR) and Python's
    hash seed change from process to process, and with them cache-set conflicts and dict orders:
    a known source of run-to-run bias in benchmarks. The worker runs with ASLR off and
    PYTHONHASHSEED=0 so every run of the same code gets the same layout. (Measured here it is a
    minor term: 6 + 6 interleaved runs, normalised MFU sd 3.5% fixed vs 4.6% random; the neighbours'
    load on the other core dominates.)
    """
    env = dict(os.environ)
    if stable_layout:
        env["PYTHONHASHSEED"] = "0"
    if threads > 0:  # keep every thread pool (OpenMP, MKL, OpenBLAS) to the config's count
        for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[k] = str(threads)
    # glibc would hand freed tensors back to the OS and fault them in again next step: thousands
    # of page faults per step whose cost swings with the neighbours' load (measured: system time
    # 0.5-10 ms of a 40 ms step). Fixed thresholds keep the heap; steady state then faults ~never.
    # hugetlb=1: malloc asks for transparent huge pages (THP_MEM_ALLOC_ENABLE: torch's allocator
    # too), so far fewer pages are placed at random: run-to-run sd of MFU 2.55% -> 2.28%, the
    # reference's 1.29% -> 0.62% (10 + 10 runs on an idle VM). Ignored where THP is off.
    env.setdefault(
        "GLIBC_TUNABLES",
        "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=17179869184:glibc.malloc.hugetlb=1",
    )
    env.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    env.update(extra_env or {})
    with tempfile.TemporaryDirectory(prefix="moeguard-canary-") as td:
        spec_path, out_path = Path(td) / "spec.json", Path(td) / "out.json"
        spec_path.write_text(json.dumps(spec))
        cmd = [python or sys.executable, *worker, str(spec_path), str(out_path)]
        try:
            proc = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                env=env,
                cwd=cwd,
                preexec_fn=functools.partial(_linux_worker_setup, stable_layout)
                if sys.platform == "linux"
                else None,
            )
        except subprocess.TimeoutExpired:
            return {"status": "error", "reason": f"measurement timed out after {timeout_s:.0f} s"}
        if not out_path.is_file():
            tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-5:]
            return {"status": "error", "reason": f"worker exited {proc.returncode}: " + " | ".join(tail)}
        result = json.loads(out_path.read_text())
        if result.get("status") == "error" and proc.stderr:
            result["stderr_tail"] = proc.stderr.strip().splitlines()[-15:]
        return result


def describe(m: Measurement) -> str:
    s = m.summary or {}
    load = m.result.get("loadavg") or [float("nan")] * 2
    return (
        f"run {m.result.get('run_id')}: MFU p50 {100 * s.get(MFU, float('nan')):.3f}% "
        f"({m.result.get('timing')} timing, step IQR {s.get('step_iqr_pct', float('nan')):.1f}%), "
        f"{s.get('window_steps', 0)} steady steps, {m.result.get('wall_s', 0):.0f} s, "
        f"load {load[0]:.1f}->{load[1]:.1f}"
    )
