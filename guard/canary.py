"""`moeguard canary`: an MFU / throughput regression gate for CI, and the kernel-choice matrix.

    moeguard canary --config configs/canary.toml --history configs/canary_history/ci-cpu.jsonl
    moeguard canary --config configs/canary.toml --history H.jsonl --record          # add a baseline
    moeguard canary --config configs/canary.toml --history H.jsonl --inject slow:10  # prove the gate
    moeguard canary --matrix attention=math,flash,efficient experts=loop,bmm,grouped_mm compile=off,on
    moeguard canary --ab set:model.attention=math set:model.attention=auto            # A/B, paired
    moeguard canary --ab py:/opt/venv-old/bin/python py:.venv/bin/python --inject slow:5

One measurement is a fixed short training run of the canary config in a fresh worker process
(clean peak-memory high-water mark, no compile caches or allocator state carried over), stored
in the run store like any run. Its steady state is the steps after `canary.warmup_steps`
(compile, allocator warm-up, LR warm-up and the profiler window excluded); each metric is the
p50 over those steps, never the last sample (a last-sample gate flips on identical runs).

Timing. On a GPU the device is not shared, so MFU and tokens/s are the trainer's wall-clock
numbers. On a CPU that other jobs share, wall time says more about the neighbours than about
the code (measured on 2 cores at load 5-10: the wall-clock p50 of identical runs spread up to
80%). So on CPU the canary
  1. runs torch on one thread: no OpenMP barrier waiting on a descheduled sibling thread;
  2. times each step in the main thread's CPU time: time spent waiting for a core is not counted;
  3. pins glibc's malloc thresholds in the worker, so freed tensors are not handed back to the
     OS and faulted in again every step (that cost 0.5-10 ms of system time per 40 ms step,
     swinging with the neighbours);
  4. times a fixed reference matmul in numpy (same thread, CPU time) right after every step, and
     reports MFU = (FLOPs/token * tokens / p50 step CPU time) / (reference FLOPs / p50 reference
     CPU time): the MFU's peak is measured in the same process, interleaved with the very steps
     it normalises, not once at start-up. Contention from neighbours slows both, to first order.
     The reference is numpy's BLAS, not torch's, so a torch regression cannot slow the yardstick
     and cancel itself out of MFU.
CPU time alone still moves 4-27% between identical runs; the normalised MFU about 3% (sd) per
process, with excursions to -9% when something outside this VM competes for the core (load 1,
wall = CPU time, yet step CPU time +27%): the model then slows 1.4-2x as much as the reference,
and none of the references tried tracked it better. Hence several processes per measurement
(see `measure`) and the gate's lines (docs/BENCHMARKS.md, canary section).

Decision. Baseline = median of the last `history_window` baseline entries of the history with
the same fingerprint (hardware class + config hash). A regression must repeat: when the first
run crosses a fail line (or MFU its warn line) the canary re-runs once and judges both runs: a
metric fails only if the mean of the two runs is past its fail line and the re-run alone is past
its warn line; both runs are reported. No baseline for the fingerprint: pass with a notice (CI on
another machine class must not fail for that). `--inject slow:PCT` burns PCT% of each step's own
compute (CPU time on CPU; a sleep after a device sync on GPU) inside the step, so the run store's
step times show it too.

A shared host drifts (on 2026-11-23 a 2-vCPU VM's step CPU time rose 22% in 30 minutes on an
unchanged build), so on CPU the gated MFU is host-adjusted (`HostFit`, fitted on the baseline's
processes), and against baseline entries that span less than `canary.baseline_min_span_h` hours
(24 in configs/canary.toml) its fail line is widened to max(configured, 3 x the baseline's own
spread, 10%) (`young_fail_line`): a regression far beyond the host's drift fails from the first
day, a drift-sized one warns. Record baselines at different times (`--record` on main after each
merge) to narrow the line back to the configured one.

`--ab A B` (guard/canary_ab.py) needs no history: it measures two environments side by side,
interleaved, and judges the paired ratio; the host's drift hits both alike.
"""

from __future__ import annotations

import argparse
import calendar
import dataclasses
import hashlib
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from guard.core.tomlconf import ConfigError, check, check_choice, from_dict, load_toml

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO / "configs" / "canary.toml"

EXIT_PASS, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
PASS, WARN, FAIL = "pass", "warn", "fail"
_SEVERITY = {PASS: 0, WARN: 1, FAIL: 2}
TIMING_CPU, TIMING_WALL = "cpu", "wall"

# History entry keys (JSONL, one object per line). The app's Canaries page reads time, git_sha,
# torch, fingerprint, config, mfu_p50, tokens_per_s_p50, verdict, baseline (and warn_pct/fail_pct).
H_TIME, H_SHA, H_TORCH, H_FP, H_HW = "time", "git_sha", "torch", "fingerprint", "hardware"
H_CFG_HASH, H_CFG, H_VERDICT, H_BASELINE = "config_hash", "config", "verdict", "baseline"
MFU, TPS, MEM, DATA_WAIT, LOSS = (
    "mfu_p50",
    "tokens_per_s_p50",
    "mem_peak_bytes",
    "data_wait_share",
    "final_loss",
)
REF = "ref_cpu_ms_p50"  # the paired reference's p50 CPU time (CPU timing): how contended the core was
MFU_ADJ = "mfu_host_adj_p50"  # CPU timing: MFU corrected for the host's speed (HostFit); the gated MFU
PROC_MFU, PROC_REF = "process_mfu", "process_ref_ms"  # per worker process: MFU p50 and reference p50
MFU_METRICS = (MFU, MFU_ADJ)

# Bumped when what a measurement means changes (window, reference, formulas, page policy): old
# baselines then stop matching (the config hash includes it) instead of being compared like with unlike.
MEASURE_VERSION = 3  # 3: the reference is numpy's matmul (was torch's)


# ---------------------------------------------------------------------------------------------
# Config: the canary TOML is a training config plus a [canary] table.


@dataclass(kw_only=True, slots=True)
class CanaryConfig:
    warmup_steps: int = 40  # leading steps excluded from the steady-state window
    timing: str = "auto"  # auto (cpu on CPU, wall on GPU) | cpu | wall
    history_window: int = 10  # baseline = median of the last N matching baseline entries
    confirm: bool = True  # re-run a failing canary once; fail only if the re-run fails too
    timeout_s: float = 900.0  # per measurement (worker process)
    stable_layout: bool = True  # worker without ASLR and with a fixed hash seed (see spawn_measurement)
    processes: int = 1  # worker processes per measurement; their median is the measurement (see measure)
    # Gates, in percent of the baseline in the bad direction (data wait: percentage points).
    mfu_warn_pct: float = 3.0
    mfu_fail_pct: float = 4.0
    tokens_warn_pct: float = 3.0
    tokens_fail_pct: float = 4.0
    tokens_cpu_warn_pct: float = 10.0  # tokens per CPU-second (not normalised): looser
    tokens_cpu_fail_pct: float = 20.0
    mem_warn_pct: float = 10.0
    mem_fail_pct: float = 25.0
    data_wait_warn_pp: float = 5.0
    data_wait_fail_pp: float = 15.0
    loss_warn_pct: float = 2.0
    loss_fail_pct: float = 5.0
    # CPU timing: MFU may fail only against baseline entries recorded over at least this many hours.
    # A baseline from one sitting holds one state of a shared host; judged against one,
    # bench/canary_power.py saw 5 false alarms in 10 clean runs (docs/BENCHMARKS.md, canary).
    baseline_min_span_h: float = 0.0
    # ... but a baseline that spans less does not disarm the MFU gate: it widens the fail line to
    # max(mfu_fail_pct, min(young_fail_cap_pct, max(young_spread_factor x the baseline's own spread,
    # young_fail_floor_pct))) (see young_fail_line): a regression far beyond the host's drift fails
    # from the first day.
    young_spread_factor: float = 3.0
    young_fail_floor_pct: float = 10.0
    young_fail_cap_pct: float = 20.0
    # `--ab A B` (guard/canary_ab.py): pairs of worker processes, one per environment, in ABBA (or
    # seeded random) order; fail when the sign-test interval of the median B/A ratio lies wholly
    # below 1 - ab_fail_pct/100. An undecided result (median past the line, interval not) adds
    # pairs, two at a time, up to ab_max_pairs. 6 pairs: with 6 the interval is the pairs' range
    # (96.9% coverage), so a fail needs all 6 below the line; 12 workers of configs/canary.toml take
    # ~3 minutes on 2 idle cores. Power and false alarms: docs/BENCHMARKS.md (A/B canary).
    ab_pairs: int = 6
    ab_max_pairs: int = 12
    ab_fail_pct: float = 1.0
    ab_confidence: float = 0.95
    ab_order: str = "abba"  # abba | random (seeded by ab_seed)
    ab_seed: int = 0

    def __post_init__(self) -> None:
        check(self.warmup_steps >= 0, "canary.warmup_steps", self.warmup_steps, "must be >= 0")
        check_choice("canary.timing", self.timing, ("auto", TIMING_CPU, TIMING_WALL))
        check(self.history_window >= 1, "canary.history_window", self.history_window, "must be >= 1")
        check(self.timeout_s > 0, "canary.timeout_s", self.timeout_s, "must be > 0")
        check(1 <= self.processes <= 50, "canary.processes", self.processes, "must be in [1, 50]")
        check(
            self.baseline_min_span_h >= 0,
            "canary.baseline_min_span_h",
            self.baseline_min_span_h,
            "must be >= 0",
        )
        check(
            self.young_spread_factor >= 0,
            "canary.young_spread_factor",
            self.young_spread_factor,
            "must be >= 0",
        )
        check(
            0 <= self.young_fail_floor_pct <= self.young_fail_cap_pct,
            "canary.young_fail_floor_pct",
            self.young_fail_floor_pct,
            f"must be in [0, young_fail_cap_pct = {self.young_fail_cap_pct}]",
        )
        check(2 <= self.ab_pairs <= 200, "canary.ab_pairs", self.ab_pairs, "must be in [2, 200]")
        check(
            self.ab_pairs <= self.ab_max_pairs <= 400,
            "canary.ab_max_pairs",
            self.ab_max_pairs,
            f"must be in [ab_pairs = {self.ab_pairs}, 400]",
        )
        check(0 <= self.ab_fail_pct < 100, "canary.ab_fail_pct", self.ab_fail_pct, "must be in [0, 100)")
        check(
            0.5 <= self.ab_confidence < 1, "canary.ab_confidence", self.ab_confidence, "must be in [0.5, 1)"
        )
        check_choice("canary.ab_order", self.ab_order, ("abba", "random"))
        for name in ("mfu", "tokens", "tokens_cpu", "mem", "loss"):
            w, f = getattr(self, f"{name}_warn_pct"), getattr(self, f"{name}_fail_pct")
            check(0 <= w <= f, f"canary.{name}_warn_pct", w, f"must be in [0, {name}_fail_pct = {f}]")
        check(
            0 <= self.data_wait_warn_pp <= self.data_wait_fail_pp,
            "canary.data_wait_warn_pp",
            self.data_wait_warn_pp,
            "must be in [0, data_wait_fail_pp]",
        )

    def measure_key(self) -> dict[str, Any]:
        """The settings that change what is measured (part of the config hash; gates are not)."""
        return {
            "warmup_steps": self.warmup_steps,
            "timing": self.timing,
            "stable_layout": self.stable_layout,
            "processes": self.processes,
            "version": MEASURE_VERSION,
        }


@dataclass(kw_only=True, slots=True)
class Setup:
    """A loaded canary config: the training config's raw tables plus the canary settings."""

    path: Path
    train: dict[str, Any]  # raw TOML tables for trainer.config.TrainConfig, overrides applied
    canary: CanaryConfig
    overrides: dict[str, Any] = field(default_factory=dict)

    def train_config(self, extra: dict[str, Any] | None = None) -> Any:
        from trainer.config import TrainConfig  # guard drives the trainer only here, lazily

        data = json.loads(json.dumps(self.train))
        _apply_overrides(data, extra or {})
        return from_dict(TrainConfig, data)

    def config_hash(self, extra: dict[str, Any] | None = None) -> str:
        """Hash of what the config file (plus overrides) says and of the canary's measurement
        settings (not its gates, not the run name or telemetry endpoints). The file's text as
        parsed, not the dataclasses with their defaults: a new config field elsewhere in the
        trainer must not orphan every baseline, and a changed default that slows the run is a
        regression for the canary to report, not a new configuration."""
        self.train_config(extra)  # validate
        data = json.loads(json.dumps(self.train))
        _apply_overrides(data, extra or {})
        data.pop("name", None)
        for k in ("collector", "otlp_endpoint"):
            data.get("telemetry", {}).pop(k, None)
        blob = json.dumps({"train": data, "canary": self.canary.measure_key()}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:10]

    def label(self, extra: dict[str, Any] | None = None) -> str:
        ov = {**self.overrides, **(extra or {})}
        sets = ",".join(f"{k}={v}" for k, v in sorted(ov.items()))
        return f"{self.path.name}[{sets}]" if sets else self.path.name


def _apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> None:
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {dotted!r}: {p!r} is not a table")
        node[leaf] = value


def load_setup(path: str | Path, overrides: dict[str, Any] | None = None) -> Setup:
    """Read the canary TOML, split off [canary], apply dotted overrides and validate both parts."""
    data = load_toml(path)
    canary_raw = data.pop("canary", {})
    overrides = dict(overrides or {})
    canary_ov = {k.removeprefix("canary."): v for k, v in overrides.items() if k.startswith("canary.")}
    train_ov = {k: v for k, v in overrides.items() if not k.startswith("canary.")}
    if not isinstance(canary_raw, dict):
        raise ConfigError("canary must be a table")
    canary = from_dict(CanaryConfig, {**canary_raw, **canary_ov}, prefix="canary.")
    _apply_overrides(data, train_ov)
    setup = Setup(path=Path(path), train=data, canary=canary, overrides=train_ov)
    cfg = setup.train_config()  # validates the training part now, with key names in errors
    check(
        cfg.train.steps > canary.warmup_steps + 5,
        "train.steps",
        cfg.train.steps,
        f"must leave a steady-state window after canary.warmup_steps = {canary.warmup_steps}",
    )
    return setup


def parse_slow(specs: list[str]) -> float:
    """`--inject slow:PCT` -> PCT (0 when not given)."""
    pct = 0.0
    for spec in specs:
        kind, sep, arg = spec.partition(":")
        if kind != "slow" or not sep:
            raise ConfigError(f"--inject {spec!r}: the canary takes slow:PCT (e.g. slow:10)")
        try:
            pct = float(arg.rstrip("%"))
        except ValueError:
            raise ConfigError(f"--inject {spec!r}: PCT {arg!r} is not a number") from None
        if not 0 < pct <= 1000:
            raise ConfigError(f"--inject {spec!r}: PCT must be in (0, 1000]")
    return pct


# ---------------------------------------------------------------------------------------------
# Measurement: runs inside the worker process (`python -m guard.canary --worker SPEC OUT`).


class _Reference:
    """A fixed matmul workload (x_ND @ w_DF -> silu -> @ w_DF^T) in numpy, timed in thread CPU time.

    numpy, not torch, on purpose: the reference is the machine's yardstick, so it must not share
    code with what the canary tests. With a torch matmul as the reference, a torch upgrade that
    slows its CPU GEMM slows the yardstick too and cancels out of MFU. numpy's own BLAS
    (OpenBLAS, one thread in the worker) does not change with torch.

    ~10 ms, working set ~1.5 MB (beyond L2, like the canary model's). Chosen over torch's matmul,
    a memory stream, many small numpy matmuls and a pure-Python workload: under the other core's
    load (31 processes, docs/NOTES.md) the numpy matmul and torch's tracked the model about equally
    (run-to-run sd of the ratio 3.0-3.2% at raw 8.6%), the stream worse (5.2%), the small-op and
    Python workloads far worse unless fitted.
    """

    N, D, F, REPS = 512, 128, 512, 4

    def __init__(self) -> None:
        import numpy as np

        rng = np.random.default_rng(0)
        self.x_ND = rng.standard_normal((self.N, self.D)).astype(np.float32)
        self.w_DF = (rng.standard_normal((self.D, self.F)) * 0.1).astype(np.float32)
        self.w_FD = np.ascontiguousarray(self.w_DF.T)
        self.flops = float(self.REPS * 2 * (2 * self.N * self.D * self.F))
        self()  # warm-up

    def __call__(self) -> float:
        import numpy as np

        c0 = time.thread_time()
        for _ in range(self.REPS):
            h_NF = self.x_ND @ self.w_DF
            h_NF = h_NF / (1.0 + np.exp(-h_NF))  # silu
            float((h_NF @ self.w_FD).sum())
        return time.thread_time() - c0


def _burn_cpu(seconds: float) -> None:
    """Busy work for `seconds` of this thread's CPU time (a kernel that got slower)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _canary_trainer(*args: Any, slow_pct: float, **kwargs: Any) -> Any:
    """A Trainer that records each step's CPU time and paired reference time, and can slow itself.

    Subclassing keeps trainer/ untouched: `train_step` is wrapped for timing, `_forward_backward`
    for the injected slowdown (inside the step, so the run store's step_time_s includes it).
    """
    import torch

    from trainer.loop import Trainer

    class CanaryTrainer(Trainer):
        def __init__(self) -> None:
            self.samples: list[dict[str, Any]] = []
            self.reference: _Reference | None = None
            self.slow_pct = slow_pct
            self._c0 = self._w0 = 0.0
            self._burned_cpu = self._slept = 0.0
            self._last_cpu: float | None = None
            self._last_wall: float | None = None
            super().__init__(*args, **kwargs)

        def train_step(self) -> Any:
            self._burned_cpu = self._slept = 0.0
            self._c0, self._w0 = time.thread_time(), time.perf_counter()
            rep = super().train_step()
            cpu = time.thread_time() - self._c0
            ref = self.reference() if self.reference is not None else float("nan")
            self._last_cpu, self._last_wall = cpu - self._burned_cpu, rep.step_time_s - self._slept
            self.samples.append(
                {
                    "step": rep.step,
                    "action": rep.action,
                    "tokens": rep.tokens,
                    "cpu_s": cpu,
                    "ref_cpu_s": ref,
                    "step_time_s": rep.step_time_s,
                    "data_wait_s": rep.data_wait_s,
                    "mfu": rep.mfu,
                    "tokens_per_s": rep.tokens_per_s,
                    "mem_peak_bytes": rep.mem_peak_bytes,
                    "loss": rep.loss,
                }
            )
            return rep

        def _forward_backward(self, batches: list[torch.Tensor]) -> torch.Tensor:
            loss = super()._forward_backward(batches)
            if self.slow_pct > 0:
                frac = self.slow_pct / 100
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                    base = self._last_wall if self._last_wall is not None else time.perf_counter() - self._w0
                    self._slept = base * frac
                    time.sleep(self._slept)
                else:
                    base = self._last_cpu if self._last_cpu is not None else time.thread_time() - self._c0
                    self._burned_cpu = base * frac
                    _burn_cpu(self._burned_cpu)
            return loss

    return CanaryTrainer()


def hardware_id(env: dict[str, Any]) -> str:
    """The hardware class a baseline is valid for: device model; on CPU the microarchitecture
    (vendor/family/model/stepping, L2 size, a hash of the ISA flags), logical CPUs and memory;
    torch threads, world size, dtype. Software (torch, CUDA) is deliberately not in
    it: a torch upgrade is exactly the regression the canary must compare across."""
    from trainer.envinfo import hardware_key

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
    setup = load_setup(spec["config"], spec.get("overrides"))
    cfg = setup.train_config(spec.get("variant"))
    cfg.name = spec["name"]
    run_dir = Path(spec["run_dir"])
    try:
        trainer = _canary_trainer(cfg, run_dir, progress=False, slow_pct=float(spec.get("slow_pct", 0.0)))
    except ValueError as e:  # a forced kernel or device this build cannot run (ConfigError too)
        return {"status": "unavailable", "reason": str(e)}
    timing = setup.canary.timing
    if timing == "auto":
        timing = TIMING_CPU if trainer.device.type == "cpu" else TIMING_WALL
    if timing == TIMING_CPU:
        trainer.reference = _Reference()
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
        "reference_flops": trainer.reference.flops if trainer.reference is not None else None,
        "peak_flops": trainer.peak,
        "torch_threads": _torch_threads(),
        "wall_s": wall,
        "loadavg": [load0[0], os.getloadavg()[0]],
        "slow_pct": trainer.slow_pct,
        "python_executable": sys.executable,
        "numpy": _numpy_version(),
        "aslr_off": _aslr_off(),
        "hash_seed": os.environ.get("PYTHONHASHSEED"),
        "samples": trainer.samples,
    }
    _annotate_run(run_dir, spec, out)
    return out


def _numpy_version() -> str:
    import numpy

    return numpy.__version__


def _aslr_off() -> bool | None:
    try:
        return bool(int(Path("/proc/self/personality").read_text(), 16) & 0x0040000)
    except (OSError, ValueError):
        return None


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _annotate_run(run_dir: Path, spec: dict[str, Any], out: dict[str, Any]) -> None:
    """Mark the run store entry as a canary run (meta.json) and keep its samples (canary.json)."""
    from guard.core import schema
    from guard.store.layout import atomic_write_json
    from guard.store.reader import read_meta

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
        import traceback

        traceback.print_exc()
        result = {"status": "error", "reason": f"{type(e).__name__}: {e}"}
    tmp = out_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, default=str))
    os.replace(tmp, out_path)
    return 0


def _no_aslr() -> None:
    """preexec_fn: exec the worker with address-space randomisation off (Linux personality flag)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        current = libc.personality(0xFFFFFFFF)
        if current != -1:
            libc.personality(current | 0x0040000)  # ADDR_NO_RANDOMIZE
    except (OSError, AttributeError):
        pass


def spawn_measurement(
    spec: dict[str, Any],
    timeout_s: float,
    threads: int,
    stable_layout: bool = True,
    *,
    python: str | None = None,
    extra_env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> dict[str, Any]:
    """Run one measurement in a fresh worker process; never raises for a failed run.

    python: the interpreter that runs the worker (default: this one); `--ab py:PATH` runs another
    venv's. extra_env and cwd decide which moeguard that interpreter imports (guard/canary_ab.py).

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
        cmd = [python or sys.executable, "-m", "guard.canary", "--worker", str(spec_path), str(out_path)]
        try:
            proc = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                env=env,
                cwd=cwd,
                preexec_fn=_no_aslr if stable_layout and sys.platform == "linux" else None,
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


# ---------------------------------------------------------------------------------------------
# Statistics of one measurement.


def _p50(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.median(xs) if xs else float("nan")


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(x for x in xs if math.isfinite(x))
    if not xs:
        return float("nan")
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def steady_window(samples: list[dict[str, Any]], warmup_steps: int, profiled: range) -> list[dict[str, Any]]:
    """Steps after warm-up, outside the profiler window, where the update was applied."""
    ok = ("apply", "none")
    return [
        s for s in samples if s["step"] >= warmup_steps and s["step"] not in profiled and s["action"] in ok
    ]


def profiled_steps(train: Any) -> range:
    t = train.telemetry
    if not t.profile:
        return range(0)
    return range(t.profile_wait, t.profile_wait + t.profile_warmup + t.profile_active + 1)


def summarize(result: dict[str, Any], warmup_steps: int, profiled: range) -> dict[str, Any]:
    """Per-metric values of one measurement (the numbers the gate compares).

    CPU timing: MFU = (FLOPs/token * tokens / p50 step CPU time) / (reference FLOPs / p50 reference
    CPU time), both p50s over the same steady-state steps. Medians first, ratio second: a per-step
    ratio adds the reference's own step-to-step jitter to every sample, while the contention it
    corrects for moves on a scale of seconds (run-to-run sd 0.7% this way, 1.3% per-step ratios).
    """
    samples = result["samples"]
    win = steady_window(samples, warmup_steps, profiled)
    fpt = result["flops_per_token"]
    cpu = [s["cpu_s"] for s in win]
    cpu_p50 = _p50(cpu)
    tokens = _p50([float(s["tokens"]) for s in win])
    mfu_wall = [s["mfu"] for s in win]
    tps_wall = [s["tokens_per_s"] for s in win]
    if result["timing"] == TIMING_CPU:
        ref_p50 = _p50([s["ref_cpu_s"] for s in win])
        mfu = (
            (fpt * tokens / cpu_p50) / (result["reference_flops"] / ref_p50) if cpu_p50 > 0 else float("nan")
        )
        tps = tokens / cpu_p50 if cpu_p50 > 0 else float("nan")
        spread = (
            100 * (_quantile(cpu, 0.75) - _quantile(cpu, 0.25)) / cpu_p50 if cpu_p50 > 0 else float("nan")
        )
    else:
        ref_p50 = float("nan")
        mfu, tps = _p50(mfu_wall), _p50(tps_wall)
        spread = 100 * (_quantile(mfu_wall, 0.75) - _quantile(mfu_wall, 0.25)) / mfu if mfu else float("nan")
    step_wall = [s["step_time_s"] for s in win]
    first = samples[0]["step_time_s"] if samples else float("nan")
    wait = sum(s["data_wait_s"] for s in win)
    total = sum(step_wall)
    tail = [s["loss"] for s in samples[-10:]]
    return {
        MFU: mfu,
        TPS: tps,
        MEM: max((s["mem_peak_bytes"] for s in samples), default=0),
        DATA_WAIT: wait / total if total > 0 else float("nan"),
        LOSS: statistics.fmean(tail) if tail else float("nan"),
        "mfu_wall_p50": _p50(mfu_wall),
        "tokens_per_s_wall_p50": _p50(tps_wall),
        "step_iqr_pct": spread,
        "step_cpu_ms_p50": 1e3 * cpu_p50,
        REF: 1e3 * ref_p50,
        "step_wall_ms_p50": 1e3 * _p50(step_wall),
        "first_step_s": first,
        "compile_s": max(0.0, first - _p50(step_wall)) if step_wall else float("nan"),
        "window_steps": len(win),
        "steps": len(samples),
    }


# ---------------------------------------------------------------------------------------------
# The gate: compare a measurement with the baseline entries.


@dataclass(frozen=True, slots=True)
class MetricSpec:
    key: str
    label: str
    higher_is_better: bool
    gate: str  # CanaryConfig field prefix: <gate>_warn_pct / <gate>_fail_pct (data_wait: _pp)
    absolute: bool = False  # compare differences in percentage points instead of ratios


def metric_specs(timing: str) -> tuple[MetricSpec, ...]:
    tps_label = "tokens/s p50 (per CPU-second)" if timing == TIMING_CPU else "tokens/s p50"
    if timing == TIMING_CPU:
        mfu = MetricSpec(MFU_ADJ, "MFU p50 (vs reference, host-adjusted)", True, "mfu")
    else:
        mfu = MetricSpec(MFU, "MFU p50", True, "mfu")
    return (
        mfu,
        MetricSpec(TPS, tps_label, True, "tokens_cpu" if timing == TIMING_CPU else "tokens"),
        MetricSpec(MEM, "peak memory", False, "mem"),
        MetricSpec(DATA_WAIT, "data-wait share", False, "data_wait", absolute=True),
        MetricSpec(LOSS, "final loss", False, "loss"),
    )


def _thresholds(c: CanaryConfig, m: MetricSpec) -> tuple[float, float]:
    unit = "pp" if m.absolute else "pct"
    return getattr(c, f"{m.gate}_warn_{unit}"), getattr(c, f"{m.gate}_fail_{unit}")


def compare(
    current: dict[str, Any], baseline: list[dict[str, Any]], c: CanaryConfig, timing: str
) -> list[dict[str, Any]]:
    """One row per metric: current, baseline median, delta, the thresholds and the level."""
    rows = []
    for m in metric_specs(timing):
        vals = [
            e[m.key] for e in baseline if isinstance(e.get(m.key), int | float) and math.isfinite(e[m.key])
        ]
        base = statistics.median(vals) if vals else None
        cur = current.get(m.key)
        warn, fail = _thresholds(c, m)
        row = {
            "metric": m.key,
            "label": m.label,
            "current": cur,
            "baseline": base,
            "n_baseline": len(vals),
            "unit": "pp" if m.absolute else "%",
            "warn": warn,
            "fail": fail,
            "delta": None,
            "level": PASS,
        }
        if base is not None and cur is not None and math.isfinite(cur):
            if m.absolute:
                delta = 100 * (cur - base)
            else:
                delta = 100 * (cur / base - 1) if base else 0.0
            bad = -delta if m.higher_is_better else delta
            row["delta"] = delta
            row["level"] = FAIL if bad >= fail else WARN if bad >= warn else PASS
        rows.append(row)
    return rows


@dataclass(frozen=True, slots=True)
class HostFit:
    """How MFU moves with the host's speed, fitted on the baseline's worker processes (CPU timing).

    Plain normalisation (MFU against the paired reference) assumes the model and the reference slow
    down alike. They do not: when something outside the VM competes for the core, the model slows
    1.4-4.4x as much as the reference in log terms (docs/NOTES.md, canary), so a slow phase of the
    host reads as an MFU drop of up to 8% on an unchanged build. Across the baseline's processes
    this is a line, log MFU = slope * log ref + c (slope = 1 - b; 0 means plain normalisation), and
    `adjust` moves a process's MFU to the baseline's median reference time along it.

    Guard rails, because a fitted correction must never hide a regression:
      - the slope is shrunk towards 0 (plain normalisation) when the baseline saw little host
        variation (ridge with `prior_sd` of log ref), and clamped to [-4, 0.5];
      - a reference time outside the range the baseline saw is clipped to that range: no
        extrapolation (a far slower host is not corrected beyond what was observed);
      - the reference is numpy's BLAS, so no torch change moves it.
    """

    slope: float = 0.0
    log_ref0: float = float("nan")  # the baseline's median log reference time (ms)
    lo: float = float("nan")  # the range of log reference times the baseline saw
    hi: float = float("nan")
    n: int = 0  # baseline processes the fit used (0: no adjustment)
    r: float = float("nan")  # correlation of log MFU with log ref over them

    def adjust(self, mfu: float, ref_ms: float) -> float:
        if self.n == 0 or not (math.isfinite(mfu) and math.isfinite(ref_ms) and ref_ms > 0):
            return mfu
        x = min(max(math.log(ref_ms), self.lo), self.hi)
        return mfu * math.exp(-self.slope * (x - self.log_ref0))


HOST_FIT_MIN_POINTS = 10
HOST_FIT_PRIOR_SD = 0.005
HOST_FIT_SLOPE_RANGE = (-4.0, 0.5)


def process_pairs(d: dict[str, Any]) -> list[tuple[float, float]]:
    """(MFU, reference ms) of each worker process of a summary or history entry (finite, > 0)."""
    mfus, refs = d.get(PROC_MFU) or [], d.get(PROC_REF) or []
    return [
        (m, r)
        for m, r in zip(mfus, refs, strict=False)
        if isinstance(m, int | float)
        and isinstance(r, int | float)
        and m > 0
        and r > 0
        and math.isfinite(m)
        and math.isfinite(r)
    ]


def fit_host(pairs: list[tuple[float, float]], prior_sd: float = HOST_FIT_PRIOR_SD) -> HostFit:
    """Least squares of log MFU on log ref, shrunk towards slope 0 (see HostFit)."""
    if len(pairs) < HOST_FIT_MIN_POINTS:
        return HostFit()
    xs = [math.log(r) for _, r in pairs]
    ys = [math.log(m) for m, _ in pairs]
    n, xm, ym = len(xs), statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - xm) ** 2 for x in xs)
    syy = sum((y - ym) ** 2 for y in ys)
    sxy = sum((x - xm) * (y - ym) for x, y in zip(xs, ys, strict=True))
    lo_s, hi_s = HOST_FIT_SLOPE_RANGE
    slope = min(max(sxy / (sxx + n * prior_sd**2), lo_s), hi_s)
    r = sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else float("nan")
    return HostFit(slope=slope, log_ref0=statistics.median(xs), lo=min(xs), hi=max(xs), n=n, r=r)


def adjusted_median(pairs: list[tuple[float, float]], fit: HostFit) -> float:
    """The median over processes of the host-adjusted MFU (one measurement's gated value)."""
    return statistics.median(fit.adjust(m, r) for m, r in pairs)


def with_host_adjusted(d: dict[str, Any], fit: HostFit) -> dict[str, Any]:
    """A copy of a summary / history entry with MFU_ADJ (the plain MFU where it has no
    per-process pairs)."""
    pairs = process_pairs(d)
    return {**d, MFU_ADJ: adjusted_median(pairs, fit) if pairs else d.get(MFU)}


def worst(levels: list[str]) -> str:
    return max(levels, key=_SEVERITY.__getitem__, default=PASS)


# ---------------------------------------------------------------------------------------------
# History (JSONL).


def read_history(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Entries in file order and the lines skipped (never raises on a bad line)."""
    if not path.is_file():
        return [], []
    entries, problems = [], []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            problems.append(f"line {n}: not JSON")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get(MFU), int | float):
            problems.append(f"line {n}: not a canary entry")
            continue
        entries.append(obj)
    return entries, problems


def baseline_span_h(baseline: list[dict[str, Any]]) -> float:
    """Hours from the first to the last recorded entry (0 when fewer than two carry a time)."""
    times = []
    for e in baseline:
        try:
            times.append(calendar.timegm(time.strptime(str(e.get(H_TIME)), "%Y-%m-%dT%H:%M:%SZ")))
        except ValueError:
            continue
    return (max(times) - min(times)) / 3600 if len(times) > 1 else 0.0


def baseline_spread_pct(baseline: list[dict[str, Any]], key: str) -> float | None:
    """The baseline's own spread of the gated MFU, in percent: (max - min) / median over its
    entries; with one entry, over that entry's worker processes. None when there is nothing to span."""
    vals = [
        e[key]
        for e in baseline
        if isinstance(e.get(key), int | float) and math.isfinite(e[key]) and e[key] > 0
    ]
    if len(vals) < 2 and len(baseline) == 1:
        vals = [m for m, _ in process_pairs(baseline[0])]
    if len(vals) < 2:
        return None
    return 100 * (max(vals) - min(vals)) / statistics.median(vals)


def young_fail_line(baseline: list[dict[str, Any]], timing: str, c: CanaryConfig) -> dict[str, Any]:
    """The MFU fail line to apply, and why (CPU timing, see CanaryConfig.baseline_min_span_h).

    A baseline whose entries span less than baseline_min_span_h has not seen a shared host's slow
    and fast spells, so the configured line would false-alarm on drift. The line is widened, not
    disarmed:

        fail = max(mfu_fail_pct, min(young_fail_cap_pct, max(young_spread_factor x spread, young_fail_floor_pct)))

    spread = the baseline's own (max - min) / median (baseline_spread_pct). The floor (10%) is about
    twice the drift this class of host shows within an hour on an unchanged build (docs/BENCHMARKS.md,
    canary: clean first-run MFU deltas down to -5.1% against a history of 0.9 h, the host's step time
    +22% in 30 minutes, two thirds of it normalised away); 3x the spread covers a baseline that saw
    more. The cap (20%) keeps the gate armed whatever a few noisy entries say: a 30% slowdown reads
    -23% MFU and fails from the first day. The warn line and the re-run rule stay as configured.
    """
    span = baseline_span_h(baseline)
    key = MFU_ADJ if timing == TIMING_CPU else MFU
    out = {
        "armed": True,
        "widened": False,
        "fail_pct": c.mfu_fail_pct,
        "configured_fail_pct": c.mfu_fail_pct,
        "spread_pct": None,
        "baseline_span_h": span,
        "reason": "",
    }
    if timing != TIMING_CPU or c.baseline_min_span_h <= 0 or not baseline or span >= c.baseline_min_span_h:
        return out
    spread = baseline_spread_pct(baseline, key)
    wide = min(c.young_fail_cap_pct, max(c.young_spread_factor * (spread or 0.0), c.young_fail_floor_pct))
    line = max(c.mfu_fail_pct, wide)
    out.update(widened=line > c.mfu_fail_pct, fail_pct=line, spread_pct=spread)
    spread_txt = "no spread (one process)" if spread is None else f"spread {spread:.1f}%"
    out["reason"] = (
        f"the {len(baseline)} baseline entries span {span:.1f} h, less than canary.baseline_min_span_h = "
        f"{c.baseline_min_span_h:g} h, so the MFU fail line is -{line:.1f}% = max(configured "
        f"-{c.mfu_fail_pct:g}%, min(cap {c.young_fail_cap_pct:g}%, max({c.young_spread_factor:g} x the "
        f"baseline's {spread_txt}, floor {c.young_fail_floor_pct:g}%))); record baselines (--record) at "
        "other times to narrow it"
    )
    return out


def select_baseline(
    entries: list[dict[str, Any]], fingerprint: str, config_hash: str, window: int
) -> list[dict[str, Any]]:
    same = [
        e
        for e in entries
        if e.get(H_BASELINE) is True and e.get(H_FP) == fingerprint and e.get(H_CFG_HASH) == config_hash
    ]
    return same[-window:]


def append_history(path: Path, entry: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(entry, sort_keys=False, default=_json_default) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _json_default(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else str(v)


def _finite(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_finite(x) for x in v]
    return v


ENV_KEYS = (
    "torch",
    "cuda",
    "python",
    "device",
    "attention_backend",
    "expert_kernel",
    "compile",
    "dtype",
    "peak_flops_source",
    "world_size",
)


def env_differences(env: dict[str, Any], baseline: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Keys whose value now differs from any baseline entry's (torch, CUDA, kernels, ...)."""
    out = []
    for k in ENV_KEYS:
        seen: dict[str, int] = {}
        for e in baseline:
            v = str((e.get("env") or {}).get(k, e.get(k, "?")))
            seen[v] = seen.get(v, 0) + 1
        now = str(env.get(k, "?"))
        if seen and (len(seen) > 1 or now not in seen):
            out.append({"key": k, "current": now, "baseline": seen})
    return out


# ---------------------------------------------------------------------------------------------
# Profile summary from the run's torch.profiler trace (Kineto chrome-trace JSON).


def profile_summary(run_dir: Path, top: int = 10) -> dict[str, Any]:
    """Top host ops (by self and by total time) and device kernels from runs/<id>/profile/."""
    import gzip

    from guard.core import schema

    files = sorted((run_dir / schema.PROFILE_DIR).glob("*.json*"), key=lambda p: p.stat().st_mtime)
    if not files:
        return {"file": None, "note": "no torch.profiler trace (telemetry.profile = false?)"}
    path = files[-1]
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as f:
            trace = json.load(f)
    except (OSError, ValueError) as e:
        return {"file": str(path), "note": f"unreadable trace: {e}"}
    events = [e for e in trace.get("traceEvents", []) if isinstance(e, dict) and e.get("ph") == "X"]
    n_steps = sum(1 for e in events if str(e.get("name", "")).startswith("ProfilerStep#")) or 1
    host = [e for e in events if e.get("cat") == "cpu_op"]
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    host_stats = _op_stats(host, nested=True)
    dev_stats = _op_stats(device, nested=False)

    def rows(stats: dict[str, list[float]], by: int, limit: int) -> list[dict[str, Any]]:
        ranked = sorted(stats.items(), key=lambda kv: kv[1][by], reverse=True)[:limit]
        return [
            {
                "op": k,
                "calls": int(v[0] / n_steps),
                "total_ms": v[1] / 1e3 / n_steps,
                "self_ms": v[2] / 1e3 / n_steps,
            }
            for k, v in ranked
        ]

    host_self_total = sum(v[2] for v in host_stats.values()) / 1e3 / n_steps
    return {
        "file": str(path),
        "profiled_steps": n_steps,
        "host_self_ms_per_step": host_self_total,
        "top_total": rows(host_stats, 1, top),
        "top_self": rows(host_stats, 2, top),
        "device_top": rows(dev_stats, 1, top),
    }


def _op_stats(events: list[dict[str, Any]], *, nested: bool) -> dict[str, list[float]]:
    """name -> [calls, total_us, self_us]; self time subtracts direct children on the same thread."""
    stats: dict[str, list[float]] = {}
    by_thread: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for e in events:
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (float(e.get("ts", 0)), -float(e.get("dur", 0))))
        stack: list[tuple[float, str]] = []  # (end_ts, name) of the enclosing ops
        for e in evs:
            ts, dur, name = float(e.get("ts", 0)), float(e.get("dur", 0)), str(e.get("name"))
            s = stats.setdefault(name, [0, 0.0, 0.0])
            s[0] += 1
            s[1] += dur
            s[2] += dur
            if not nested:
                continue
            while stack and stack[-1][0] <= ts:
                stack.pop()
            if stack:
                stats[stack[-1][1]][2] -= dur  # the parent's self time excludes this child
            stack.append((ts + dur, name))
    return stats


def profile_deltas(current: dict[str, Any], baseline: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-op self time per step now vs the baseline entries' median (ops in either top list)."""
    now = {r["op"]: r["self_ms"] for r in current.get("top_self", [])}
    base: dict[str, list[float]] = {}
    for e in baseline:
        for op, ms in (e.get("profile_top") or {}).items():
            base.setdefault(op, []).append(ms)
    out = []
    for op in list(now) + [o for o in base if o not in now]:
        b = statistics.median(base[op]) if op in base else None
        n = now.get(op)
        out.append(
            {
                "op": op,
                "self_ms": n,
                "baseline_ms": b,
                "delta_pct": 100 * (n / b - 1) if n is not None and b else None,
            }
        )
    return out


# ---------------------------------------------------------------------------------------------
# One canary: measure, compare, confirm, report, record.


def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def _slug(text: str) -> str:
    keep = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in text)
    return "_".join(p for p in keep.split("_") if p)[:80]


def _new_run_dir(runs: Path, name: str) -> Path:
    d = runs / name
    n = 1
    while d.exists():
        n += 1
        d = runs / f"{name}-{n}"
    return d


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
    stamp = _stamp()
    for p in range(k):
        suffix = f"p{p + 1}" if k > 1 else ""
        run_dir = _new_run_dir(runs, f"{_slug(name)}-{stamp}-r{attempt}{suffix}")
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
            spec, setup.canary.timeout_s, cfg.train.threads, setup.canary.stable_layout
        )
        if result.get("status") != "ok":
            return Measurement(result=result, attempt=attempt)
        results.append(result)
        if k > 1:
            one = summarize(result, setup.canary.warmup_steps, profiled_steps(cfg))
            _progress(f"  process {p + 1}/{k}: MFU p50 {100 * one[MFU]:.3f}% ({result['wall_s']:.0f} s)")
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
    """What one worker process measures (`python -m guard.canary --worker SPEC OUT`)."""
    return {
        "config": str(setup.path.resolve()),
        "overrides": {**setup.overrides, **_canary_overrides(setup)},
        "variant": variant or {},
        "variant_label": variant_label,
        "name": name,
        "run_dir": str(run_dir.resolve()),
        "slow_pct": slow_pct,
        "attempt": attempt,
    }


def pool_processes(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """One measurement from its processes: the median of each rate (robust to one odd process),
    the highest peak memory, step counts summed; per-process MFU kept for the report."""
    if len(summaries) == 1:
        return {**summaries[0], PROC_MFU: [summaries[0][MFU]], PROC_REF: [summaries[0][REF]]}
    out = dict(summaries[0])
    for key in (
        MFU,
        TPS,
        DATA_WAIT,
        LOSS,
        REF,
        "mfu_wall_p50",
        "tokens_per_s_wall_p50",
        "step_iqr_pct",
        "step_cpu_ms_p50",
        "step_wall_ms_p50",
        "first_step_s",
        "compile_s",
    ):
        out[key] = _p50([s.get(key, float("nan")) for s in summaries])
    out[MEM] = max(s[MEM] for s in summaries)
    out["window_steps"] = sum(s["window_steps"] for s in summaries)
    out["steps"] = sum(s["steps"] for s in summaries)
    out[PROC_MFU] = [s[MFU] for s in summaries]
    out[PROC_REF] = [s[REF] for s in summaries]
    return out


# [canary] keys only the parent reads: not passed to workers, so a worker of an older moeguard (`--ab
# py:PATH` with that venv's own install) does not reject keys it does not know.
PARENT_ONLY_KEYS = ("young_", "ab_")


def _canary_overrides(setup: Setup) -> dict[str, Any]:
    """The worker re-reads the TOML; pass the already-applied [canary] values along."""
    return {
        f"canary.{f.name}": getattr(setup.canary, f.name)
        for f in dataclasses.fields(CanaryConfig)
        if not f.name.startswith(PARENT_ONLY_KEYS)
    }


def _progress(msg: str) -> None:
    print(f"canary: {msg}", file=sys.stderr, flush=True)


def _describe(m: Measurement) -> str:
    s = m.summary or {}
    load = m.result.get("loadavg") or [float("nan")] * 2
    return (
        f"run {m.result.get('run_id')}: MFU p50 {100 * s.get(MFU, float('nan')):.3f}% "
        f"({m.result.get('timing')} timing, step IQR {s.get('step_iqr_pct', float('nan')):.1f}%), "
        f"{s.get('window_steps', 0)} steady steps, {m.result.get('wall_s', 0):.0f} s, "
        f"load {load[0]:.1f}->{load[1]:.1f}"
    )


def run_canary(args: argparse.Namespace, setup: Setup) -> int:
    slow = parse_slow(args.inject)
    if slow and (args.record or args.append):
        raise ConfigError("--inject slows the run on purpose; it cannot be --record'ed or --append'ed")
    history_path = Path(args.history)
    entries, problems = read_history(history_path)
    for p in problems:
        _progress(f"warning: {history_path}: {p} (skipped)")
    name = f"canary[slow:{slow:g}]" if slow else "canary"
    config_hash = setup.config_hash()

    runs: list[Measurement] = []
    _progress(f"measuring {setup.label()} (config hash {config_hash}) ...")
    first = measure(setup, Path(args.runs), name=name, slow_pct=slow)
    runs.append(first)
    if first.result.get("status") == "unavailable":
        print(f"moeguard canary: the config cannot run here: {first.result.get('reason')}", file=sys.stderr)
        return EXIT_USAGE
    if not first.ok:
        return _report_error(args, first)
    _progress(_describe(first))
    timing = first.result["timing"]
    hardware = first.result["hardware"]
    fingerprint = f"{hardware} | cfg {config_hash}"
    baseline = select_baseline(entries, fingerprint, config_hash, setup.canary.history_window)
    fit = fit_host([p for e in baseline for p in process_pairs(e)]) if timing == TIMING_CPU else HostFit()
    baseline = [with_host_adjusted(e, fit) for e in baseline]
    first.summary = with_host_adjusted(first.summary, fit)

    line = young_fail_line(baseline, timing, setup.canary)
    gates = (
        dataclasses.replace(setup.canary, mfu_fail_pct=line["fail_pct"]) if line["widened"] else setup.canary
    )
    comparisons = [compare(first.summary, baseline, gates, timing)] if baseline else [[]]
    pooled: list[dict[str, Any]] = []
    summary = first.summary
    notice = ""
    if not baseline and not args.record:  # a --record with no baseline records the first one: no hint
        notice = (
            f"no baseline for {fingerprint}; record one with --record "
            f"(moeguard canary --config {args.config} --history {args.history} --record)"
        )
    elif gates.confirm and needs_confirmation(comparisons[0]):
        _progress("the first run regressed; re-running once to confirm ...")
        second = measure(setup, Path(args.runs), name=name, slow_pct=slow, attempt=2)
        runs.append(second)
        if not second.ok:
            return _report_error(args, second)
        second.summary = with_host_adjusted(second.summary, fit)
        _progress(_describe(second))
        comparisons.append(compare(second.summary, baseline, gates, timing))
        summary = pool_summaries([first.summary, second.summary])
        pooled = compare(summary, baseline, gates, timing)
    decision = decide(comparisons, pooled)
    verdict = worst([d["final"] for d in decision])
    if line["widened"]:
        notice = "young baseline: " + line["reason"]
    if pooled and verdict != FAIL and any(r["level"] == FAIL for r in comparisons[0]):
        notice = "; ".join(
            x
            for x in (
                notice,
                "the first run failed but the regression did not repeat in the re-run: not failing",
            )
            if x
        )
    report = build_report(
        setup=setup,
        args=args,
        runs=runs,
        comparisons=comparisons,
        pooled=pooled,
        decision=decision,
        baseline=baseline,
        verdict=verdict,
        notice=notice,
        fingerprint=fingerprint,
        config_hash=config_hash,
        slow=slow,
        problems=problems,
    )
    report["host_fit"] = _finite(host_fit_report(fit, runs))
    report["mfu_gate"] = _finite(line)
    record_as_baseline = args.record and (verdict != FAIL or args.accept)
    if args.record or args.append:
        entry = history_entry(runs[-1], summary, setup, fingerprint, config_hash, verdict, record_as_baseline)
        entry["fail_pct_applied"] = gates.mfu_fail_pct  # the widened line on a young CPU baseline
        append_history(history_path, entry)
        report["recorded"] = {"path": str(history_path), "baseline": record_as_baseline}
    write_reports(report, Path(args.report_dir))
    print_summary(report)
    if args.record and not record_as_baseline:
        print(
            "moeguard canary: the run failed, so it was appended as a non-baseline entry; to accept a new "
            "level on purpose (an intended change), re-run with --record --accept",
            file=sys.stderr,
        )
    return EXIT_FAIL if verdict == FAIL else EXIT_PASS


def host_fit_report(fit: HostFit, runs: list[Measurement]) -> dict[str, Any]:
    """The fit and how far each run's host was from the baseline's (reference ms, median)."""
    ref0 = math.exp(fit.log_ref0) if fit.n else None
    return {
        **dataclasses.asdict(fit),
        "ref0_ms": ref0,
        "run_ref_ms": [(m.summary or {}).get(REF) for m in runs],
        "ref_range_ms": [math.exp(fit.lo), math.exp(fit.hi)] if fit.n else None,
    }


def needs_confirmation(rows: list[dict[str, Any]]) -> bool:
    """Re-run when any gate fails, or when MFU (the gate with the most noise) is past its warn line."""
    return any(r["level"] == FAIL or (r["metric"] in MFU_METRICS and r["level"] == WARN) for r in rows)


def pool_summaries(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """The runs' gate metrics averaged (the baseline entry of a confirmed canary)."""
    out = dict(summaries[-1])
    for k in (PROC_MFU, PROC_REF):
        out[k] = [v for s in summaries for v in s.get(k) or []]
    for k in (MFU, MFU_ADJ, TPS, MEM, DATA_WAIT, LOSS, REF, "mfu_wall_p50", "tokens_per_s_wall_p50"):
        vals = [s[k] for s in summaries if isinstance(s.get(k), int | float) and math.isfinite(s[k])]
        if vals or k in out:
            out[k] = statistics.fmean(vals) if vals else float("nan")
    return out


def decide(comparisons: list[list[dict[str, Any]]], pooled: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Final level per metric. One run: its level. Confirmed (two runs): fail only if the mean of
    both runs is past the fail line AND the re-run alone is past the warn line (it regressed too);
    warn if anything was past a line; else pass."""
    first = comparisons[0]
    out = []
    for i, row in enumerate(first):
        d = {
            "metric": row["metric"],
            "label": row["label"],
            "first": row["level"],
            "second": None,
            "pooled": None,
            "pooled_delta": None,
            "final": row["level"],
        }
        if pooled:
            second, both = comparisons[1][i], pooled[i]
            d.update(second=second["level"], pooled=both["level"], pooled_delta=both["delta"])
            repeated = both["level"] == FAIL and _SEVERITY[second["level"]] >= _SEVERITY[WARN]
            seen = worst([row["level"], second["level"], both["level"]])
            d["final"] = FAIL if repeated else (WARN if seen != PASS else PASS)
        out.append(d)
    return out


def _report_error(args: argparse.Namespace, m: Measurement) -> int:
    print(f"moeguard canary: measurement failed: {m.result.get('reason')}", file=sys.stderr)
    for line in m.result.get("stderr_tail", []):
        print(f"  {line}", file=sys.stderr)
    return EXIT_FAIL


def history_entry(
    m: Measurement,
    s: dict[str, Any],
    setup: Setup,
    fingerprint: str,
    config_hash: str,
    verdict: str,
    baseline: bool,
) -> dict[str, Any]:
    """The JSONL line; `s` is the run's summary (the two runs' mean when the canary re-ran)."""
    r, env = m.result, m.result.get("env", {})
    prof = s.get("profile", {})
    return _finite(
        {
            H_TIME: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            H_SHA: env.get("git_sha", "unknown"),
            H_TORCH: env.get("torch", "?"),
            H_FP: fingerprint,
            H_HW: r.get("hardware"),
            H_CFG_HASH: config_hash,
            H_CFG: setup.label(),
            MFU: s.get(MFU),
            TPS: s.get(TPS),
            MEM: s.get(MEM),
            DATA_WAIT: s.get(DATA_WAIT),
            LOSS: s.get(LOSS),
            H_VERDICT: verdict,
            H_BASELINE: baseline,
            "timing": r.get("timing"),
            "mfu_wall_p50": s.get("mfu_wall_p50"),
            "tokens_per_s_wall_p50": s.get("tokens_per_s_wall_p50"),
            REF: s.get(REF),
            PROC_MFU: s.get(PROC_MFU),
            PROC_REF: s.get(PROC_REF),
            "step_cpu_ms_p50": s.get("step_cpu_ms_p50"),
            "step_iqr_pct": s.get("step_iqr_pct"),
            "warn_pct": setup.canary.mfu_warn_pct,
            "fail_pct": setup.canary.mfu_fail_pct,
            "run_id": r.get("run_id"),
            "runs": 1 + (m.attempt > 1),
            "loadavg": r.get("loadavg"),
            "env": {k: env.get(k) for k in ENV_KEYS},
            "profile_top": {row["op"]: round(row["self_ms"], 4) for row in prof.get("top_self", [])},
        }
    )


# ---------------------------------------------------------------------------------------------
# Reports (Markdown + JSON).


def build_report(
    *,
    setup: Setup,
    args: argparse.Namespace,
    runs: list[Measurement],
    comparisons: list[list[dict[str, Any]]],
    pooled: list[dict[str, Any]],
    decision: list[dict[str, Any]],
    baseline: list[dict[str, Any]],
    verdict: str,
    notice: str,
    fingerprint: str,
    config_hash: str,
    slow: float,
    problems: list[str],
) -> dict[str, Any]:
    decisive = runs[-1]
    env = decisive.result.get("env", {})
    prof = (decisive.summary or {}).get("profile", {})
    failing = [d["metric"] for d in decision if d["final"] == FAIL]
    warned = [d["metric"] for d in decision if d["final"] == WARN]
    return _finite(
        {
            "verdict": verdict,
            "exit_code": EXIT_FAIL if verdict == FAIL else EXIT_PASS,
            "regressed_metrics": failing,
            "warned_metrics": warned,
            "decision": decision,
            "pooled": pooled,
            "notice": notice,
            "config": str(setup.path),
            "config_label": setup.label(),
            "config_hash": config_hash,
            "fingerprint": fingerprint,
            "hardware": decisive.result.get("hardware"),
            "timing": decisive.result.get("timing"),
            "inject_slow_pct": slow,
            "history": str(args.history),
            "history_problems": problems,
            "gates": {f.name: getattr(setup.canary, f.name) for f in dataclasses.fields(CanaryConfig)},
            "baseline": {
                "n": len(baseline),
                "entries": [
                    {k: e.get(k) for k in (H_TIME, H_SHA, H_TORCH, MFU, MFU_ADJ, TPS, "run_id")}
                    for e in baseline
                ],
            },
            "runs": [
                {
                    "attempt": m.attempt,
                    "run_id": m.result.get("run_id"),
                    "run_dir": m.result.get("run_dir"),
                    "loadavg": m.result.get("loadavg"),
                    "wall_s": m.result.get("wall_s"),
                    "summary": {k: v for k, v in (m.summary or {}).items() if k != "profile"},
                    "comparison": comparisons[i] if i < len(comparisons) else [],
                    "verdict": worst([r["level"] for r in comparisons[i]]) if i < len(comparisons) else PASS,
                }
                for i, m in enumerate(runs)
            ],
            "env": env,
            "env_differences": env_differences(env, baseline),
            "profile": prof,
            "profile_vs_baseline": profile_deltas(prof, baseline) if baseline else [],
        }
    )


def _fmt_value(metric: str, v: Any) -> str:
    if v is None:
        return "—"
    if metric == MFU or metric.startswith("mfu"):
        return f"{100 * v:.3f}%"
    if metric == MEM:
        return f"{v / 2**20:,.0f} MiB"
    if metric == DATA_WAIT:
        return f"{100 * v:.2f}%"
    if metric == LOSS:
        return f"{v:.4f}"
    return f"{v:,.0f}"


def _fmt_delta(row: dict[str, Any]) -> str:
    if row["delta"] is None:
        return "—"
    return f"{row['delta']:+.2f}{' pp' if row['unit'] == 'pp' else '%'}"


def render_markdown(rep: dict[str, Any]) -> str:
    icon = {PASS: "PASS", WARN: "WARN", FAIL: "FAIL"}[rep["verdict"]]
    out = [f"# Canary: {icon}", ""]
    if rep["notice"]:
        out += [f"> {rep['notice']}", ""]
    out += [
        f"- config: `{rep['config_label']}` (hash `{rep['config_hash']}`)",
        f"- fingerprint: `{rep['fingerprint']}`",
        f"- timing: {rep['timing']} ("
        + (
            "thread CPU time, MFU against a numpy reference matmul timed right after every step"
            if rep["timing"] == TIMING_CPU
            else "wall clock"
        )
        + ")",
        f"- baseline: median of {rep['baseline']['n']} baseline entries of `{rep['history']}`",
    ]
    out += _host_fit_markdown(rep.get("host_fit"))
    gate = rep.get("mfu_gate") or {}
    if gate.get("reason"):
        out.append(f"- MFU gate: {gate['reason']}")
    if rep["inject_slow_pct"]:
        out.append(f"- injected slowdown: {rep['inject_slow_pct']:g}% of each step's compute")
    if rep["regressed_metrics"]:
        out.append(f"- regressed (fail): {', '.join(rep['regressed_metrics'])}")
    if rep["warned_metrics"]:
        out.append(f"- warned: {', '.join(rep['warned_metrics'])}")
    if rep["pooled"]:
        out += [
            "",
            "## Decision: both runs",
            "",
            "The first run regressed, so the canary re-ran once. A metric fails only if the mean of both runs "
            "is past its fail line and the re-run alone is past its warn line.",
            "",
            "| metric | run 1 | run 2 | mean of both | delta (mean) | final |",
            "|---|---|---|---|---|---|",
        ]
        by = {r["metric"]: r for r in rep["pooled"]}
        for d in rep["decision"]:
            p = by.get(d["metric"], {})
            out.append(
                f"| {d['label']} | {d['first']} | {d['second']} | {_fmt_value(d['metric'], p.get('current'))} | "
                f"{_fmt_delta(p) if p else '—'} | **{d['final']}** |"
            )
    for run in rep["runs"]:
        s = run["summary"]
        load = run.get("loadavg") or [None, None]
        out += [
            "",
            f"## Run {run['attempt']}: `{run['run_id']}` — {run['verdict']}",
            "",
            f"{s.get('window_steps')} steady-state steps of {s.get('steps')}; wall {run.get('wall_s') or 0:.0f} s; "
            f"load average {load[0] or 0:.1f} -> {load[1] or 0:.1f}; step-time IQR {s.get('step_iqr_pct') or 0:.1f}%; "
            f"first step (incl. compile) {s.get('first_step_s') or 0:.2f} s",
            "",
        ]
        per_process = [v for v in s.get("process_mfu") or [] if isinstance(v, int | float)]
        if len(per_process) > 1:
            out += [
                f"MFU p50 of each of its {len(per_process)} worker processes (the measurement is their "
                f"median): " + ", ".join(f"{100 * v:.3f}%" for v in per_process),
                "",
            ]
        if run["comparison"]:
            out += [
                "| metric | current | baseline | delta | warn / fail | level |",
                "|---|---|---|---|---|---|",
            ]
            for r in run["comparison"]:
                unit = " pp" if r["unit"] == "pp" else "%"
                out.append(
                    f"| {r['label']} | {_fmt_value(r['metric'], r['current'])} | "
                    f"{_fmt_value(r['metric'], r['baseline'])} | {_fmt_delta(r)} | "
                    f"{r['warn']:g}{unit} / {r['fail']:g}{unit} | {r['level']} |"
                )
        else:
            out += ["| metric | value |", "|---|---|"]
            for k in (MFU, TPS, MEM, DATA_WAIT, LOSS):
                out.append(f"| {k} | {_fmt_value(k, s.get(k))} |")
        out.append(
            f"\nWall clock (not gated on CPU): MFU p50 {_fmt_value('mfu', s.get('mfu_wall_p50'))}, "
            f"tokens/s p50 {_fmt_value('tps', s.get('tokens_per_s_wall_p50'))}; "
            f"step p50 {s.get('step_cpu_ms_p50') or 0:.1f} ms CPU / {s.get('step_wall_ms_p50') or 0:.1f} ms wall."
        )
    out += ["", "## Environment vs baseline", ""]
    if rep["env_differences"]:
        out += ["| key | now | baseline entries |", "|---|---|---|"]
        for d in rep["env_differences"]:
            seen = ", ".join(f"{k} ×{n}" for k, n in d["baseline"].items())
            out.append(f"| {d['key']} | {d['current']} | {seen} |")
    elif rep["baseline"]["n"]:
        out.append("No differences in " + ", ".join(ENV_KEYS) + ".")
    else:
        out.append("No baseline entries to compare with.")
    env = rep.get("env") or {}
    out.append(
        f"\nNow: torch {env.get('torch')}, CUDA {env.get('cuda')}, device {env.get('device')}, attention "
        f"{env.get('attention_backend')}, experts {env.get('expert_kernel')}, compile {env.get('compile')}, "
        f"git {env.get('git_sha')}."
    )
    out += _profile_markdown(rep)
    return "\n".join(out) + "\n"


def _host_fit_markdown(fit: dict[str, Any] | None) -> list[str]:
    if not fit:
        return []
    if not fit.get("n"):
        return [
            "- host adjustment: none (fewer than "
            f"{HOST_FIT_MIN_POINTS} baseline processes with reference times): MFU is plain-normalised"
        ]
    runs = ", ".join(f"{v:.2f}" for v in fit.get("run_ref_ms") or [] if isinstance(v, int | float))
    lo, hi = fit["ref_range_ms"]
    return [
        f"- host adjustment: over {fit['n']} baseline processes log MFU = {fit['slope']:+.2f} x log(reference ms) "
        f"+ c (r = {fit['r'] if fit['r'] is not None else float('nan'):.2f}); each process's MFU is moved along "
        f"it to the baseline's median reference {fit['ref0_ms']:.2f} ms (seen {lo:.2f}-{hi:.2f} ms, clipped to "
        f"that range). This run: reference {runs} ms"
    ]


def _profile_markdown(rep: dict[str, Any]) -> list[str]:
    prof = rep.get("profile") or {}
    out = ["", "## Profile (torch.profiler window of the decisive run)", ""]
    if not prof.get("file"):
        return out + [prof.get("note", "no trace")]
    out.append(
        f"`{prof['file']}`: {prof['profiled_steps']} profiled step(s); times are per step, wall clock "
        'inside the trace (self = excluding child ops). "vs baseline" compares self time with the '
        "median of the baseline entries' profiles: a few profiled steps on a shared CPU, so read only "
        "large changes (tens of percent) or ops that appear or vanish."
    )
    deltas = {d["op"]: d for d in rep.get("profile_vs_baseline", [])}
    for title, key in (("Top ops by total time", "top_total"), ("Top ops by self time", "top_self")):
        out += [
            "",
            f"**{title}**",
            "",
            "| op | calls | total ms | self ms | self vs baseline |",
            "|---|---|---|---|---|",
        ]
        for r in prof.get(key, []):
            d = deltas.get(r["op"], {}).get("delta_pct")
            out.append(
                f"| `{r['op']}` | {r['calls']} | {r['total_ms']:.3f} | {r['self_ms']:.3f} | "
                f"{'—' if d is None else f'{d:+.0f}%'} |"
            )
    if prof.get("device_top"):
        out += ["", "**Top device kernels**", "", "| kernel | calls | total ms |", "|---|---|---|"]
        for r in prof["device_top"]:
            out.append(f"| `{r['op'][:90]}` | {r['calls']} | {r['total_ms']:.3f} |")
    return out


def write_reports(rep: dict[str, Any], report_dir: Path, stem: str = "canary") -> tuple[Path, Path]:
    report_dir.mkdir(parents=True, exist_ok=True)
    md, js = report_dir / f"{stem}.md", report_dir / f"{stem}.json"
    rep["report_md"], rep["report_json"] = str(md), str(js)
    js.write_text(json.dumps(rep, indent=2, default=_json_default) + "\n")
    md.write_text(render_markdown(rep) if stem == "canary" else render_matrix_markdown(rep))
    return md, js


def print_summary(rep: dict[str, Any]) -> None:
    rows = rep["pooled"] or rep["runs"][0]["comparison"]
    final = {d["metric"]: d["final"] for d in rep["decision"]}
    for r in rows:
        if final.get(r["metric"], PASS) != PASS:
            unit = " pp" if r["unit"] == "pp" else "%"
            what = "mean of both runs" if rep["pooled"] else "current"
            print(
                f"canary {final[r['metric']].upper()}: {r['metric']} {_fmt_value(r['metric'], r['current'])} ({what}) vs "
                f"baseline {_fmt_value(r['metric'], r['baseline'])} ({_fmt_delta(r)}; warn {r['warn']:g}{unit}, "
                f"fail {r['fail']:g}{unit})"
            )
    if rep["notice"]:
        print(f"canary notice: {rep['notice']}")
    tail = ""
    mfu = next((r for r in rows if r["metric"] in MFU_METRICS), None)
    if mfu is not None and mfu["delta"] is not None:
        tail = f" ({_fmt_delta(mfu)} vs the median of {mfu['n_baseline']} baseline entries)"
    now = mfu["current"] if mfu else rep["runs"][-1]["summary"].get(MFU)
    print(
        f"canary {rep['verdict'].upper()}: MFU p50 {_fmt_value(MFU, now)}{tail}, "
        f"{len(rep['runs'])} run(s); report: {rep.get('report_md', '')}"
    )


# ---------------------------------------------------------------------------------------------
# The kernel-choice matrix: variants interleaved (A B C A B C ...) so drift hits all alike.

MATRIX_AXES = {"attention": "model.attention", "experts": "model.experts_kernel", "compile": "train.compile"}
_BOOL_WORDS = {"on": True, "off": False, "true": True, "false": False, "1": True, "0": False}


def parse_matrix(tokens: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """['attention=math,flash', 'compile=off,on'] -> [(label, overrides)] (the cartesian product).

    Axes: attention, experts, compile, or any dotted config key (e.g. model.top_k=1,2)."""
    axes: list[tuple[str, str, list[tuple[str, Any]]]] = []
    for tok in tokens:
        name, sep, vals = tok.partition("=")
        if not sep or not name or not vals:
            raise ConfigError(
                f"--matrix {tok!r}: expected AXIS=V1,V2 (axes: {', '.join(MATRIX_AXES)} or a dotted key)"
            )
        key = MATRIX_AXES.get(name, name)
        if "." not in key:
            raise ConfigError(
                f"--matrix {tok!r}: unknown axis {name!r}; axes: {', '.join(MATRIX_AXES)} or a dotted key"
            )
        values = []
        for raw in (v.strip() for v in vals.split(",") if v.strip()):
            values.append((raw, _matrix_value(key, raw)))
        axes.append((name, key, values))
    variants = []
    for combo in itertools.product(*(vals for _, _, vals in axes)):
        label = " ".join(f"{name}={raw}" for (name, _, _), (raw, _) in zip(axes, combo, strict=True))
        variants.append((label, {key: v for (_, key, _), (_, v) in zip(axes, combo, strict=True)}))
    return variants


def _matrix_value(key: str, raw: str) -> Any:
    if key == "train.compile" or raw.lower() in ("on", "off"):
        if raw.lower() not in _BOOL_WORDS:
            raise ConfigError(f"--matrix {key}={raw!r}: expected on|off")
        return _BOOL_WORDS[raw.lower()]
    for conv in (int, float):
        try:
            return conv(raw)
        except ValueError:
            pass
    return raw


def run_matrix(args: argparse.Namespace, setup: Setup) -> int:
    variants = parse_matrix(args.matrix)
    for _, ov in variants:  # validate every variant's config before spending minutes measuring
        setup.train_config(ov)
    repeats = max(1, args.repeats)
    slow = parse_slow(args.inject)
    results: dict[str, list[Measurement]] = {label: [] for label, _ in variants}
    unavailable: dict[str, str] = {}
    n_total = len(variants) * repeats
    k = 0
    for r in range(1, repeats + 1):
        for label, ov in variants:
            k += 1
            if label in unavailable:
                continue
            _progress(f"[{k}/{n_total}] {label} (repeat {r}) ...")
            m = measure(
                setup,
                Path(args.runs),
                name=f"canary[{label}]",
                variant=ov,
                variant_label=label,
                slow_pct=slow,
                attempt=r,
            )
            results[label].append(m)
            if m.result.get("status") == "unavailable":
                unavailable[label] = m.result.get("reason", "")
                _progress(f"    unavailable: {unavailable[label]}")
            elif m.ok:
                _progress(f"    {_describe(m)}")
            else:
                _progress(f"    error: {m.result.get('reason')}")
    rep = matrix_report(setup, variants, results, repeats)
    md, _ = write_reports(rep, Path(args.report_dir), stem="matrix")
    print(render_matrix_table(rep))
    print(f"report: {md}")
    return EXIT_FAIL if any(v["status"] == "error" for v in rep["variants"]) else EXIT_PASS


def matrix_report(
    setup: Setup,
    variants: list[tuple[str, dict[str, Any]]],
    results: dict[str, list[Measurement]],
    repeats: int,
) -> dict[str, Any]:
    rows = []
    for label, ov in variants:
        ms = results[label]
        ok = [m for m in ms if m.ok]
        row: dict[str, Any] = {
            "variant": label,
            "overrides": ov,
            "runs": [m.result.get("run_id") for m in ok],
        }
        if ms and ms[0].result.get("status") == "unavailable":
            row.update(status="unavailable", reason=ms[0].result.get("reason", ""))
        elif not ok:
            row.update(status="error", reason="; ".join(str(m.result.get("reason")) for m in ms))
        else:
            mfus = [m.summary[MFU] for m in ok]
            med = statistics.median(mfus)
            row.update(
                status="ok" if len(ok) == len(ms) else "partial",
                reason="" if len(ok) == len(ms) else f"{len(ms) - len(ok)} repeat(s) failed",
                timing=ok[0].result.get("timing"),
                mfu_p50=med,
                mfu_spread_pct=100 * (max(mfus) - min(mfus)) / med if med else None,
                mfu_repeats=mfus,
                tokens_per_s_p50=statistics.median(m.summary[TPS] for m in ok),
                mfu_wall_p50=statistics.median(m.summary["mfu_wall_p50"] for m in ok),
                tokens_per_s_wall_p50=statistics.median(m.summary["tokens_per_s_wall_p50"] for m in ok),
                first_step_s=statistics.median(m.summary["first_step_s"] for m in ok),
                compile_s=statistics.median(m.summary["compile_s"] for m in ok),
                final_loss=statistics.median(m.summary[LOSS] for m in ok),
                attention_backend=ok[0].result["env"].get("attention_backend"),
                expert_kernel=ok[0].result["env"].get("expert_kernel"),
                loadavg=[m.result.get("loadavg") for m in ok],
            )
        rows.append(row)
    return _finite(
        {
            "config": str(setup.path),
            "config_label": setup.label(),
            "repeats": repeats,
            "order": "interleaved: every variant once per repeat, in the same order",
            "variants": rows,
        }
    )


def render_matrix_table(rep: dict[str, Any]) -> str:
    ok = sorted((v for v in rep["variants"] if v.get("mfu_p50") is not None), key=lambda v: -v["mfu_p50"])
    rest = [v for v in rep["variants"] if v.get("mfu_p50") is None]
    timing = ok[0].get("timing") if ok else None
    tps = "tokens/CPU-s p50" if timing == TIMING_CPU else "tokens/s p50"
    lines = [
        f"| variant | MFU p50 | spread | {tps} | wall MFU p50 | wall tokens/s | first step s | loss | status |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for v in ok:
        lines.append(
            f"| {v['variant']} | {100 * v['mfu_p50']:.3f}% | {v['mfu_spread_pct'] or 0:.1f}% | "
            f"{v['tokens_per_s_p50']:,.0f} | {100 * (v['mfu_wall_p50'] or 0):.3f}% | "
            f"{v['tokens_per_s_wall_p50'] or 0:,.0f} | {v['first_step_s'] or 0:.2f} | "
            f"{v['final_loss'] or 0:.4f} | {v['status']} |"
        )
    for v in rest:
        lines.append(
            f"| {v['variant']} | — | — | — | — | — | — | — | {v['status']}: {v.get('reason', '')[:120]} |"
        )
    return "\n".join(lines)


def render_matrix_markdown(rep: dict[str, Any]) -> str:
    return "\n".join(
        [
            "# Canary kernel matrix",
            "",
            f"- config: `{rep['config_label']}`; {rep['repeats']} repeat(s), {rep['order']}",
            "- MFU p50: median over repeats of each run's steady-state p50 (CPU: against the paired reference); "
            "spread: (max - min) / median over repeats; first step includes torch.compile time when compile=on.",
            "",
            render_matrix_table(rep),
            "",
        ]
    )


# ---------------------------------------------------------------------------------------------
# CLI


def configure(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = __doc__.split("\n", 2)[2]
    p.add_argument(
        "--config",
        type=Path,
        default=DEFAULT_CONFIG,
        help="canary config: a training config plus a [canary] table (default: configs/canary.toml)",
    )
    p.add_argument(
        "--history", type=Path, help="JSONL history to compare against (required unless --matrix or --ab)"
    )
    p.add_argument("--record", action="store_true", help="append this run to the history as a baseline entry")
    p.add_argument(
        "--accept",
        action="store_true",
        help="with --record: record even a failing run as a baseline (an intended change)",
    )
    p.add_argument(
        "--append",
        action="store_true",
        help="append this run to the history as a non-baseline entry (a nightly job's trend)",
    )
    p.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="slow:PCT",
        help="slow each step by PCT percent (to prove the gate fails)",
    )
    p.add_argument(
        "--report-dir",
        type=Path,
        default=None,
        help="where canary.md/canary.json (or matrix.md/matrix.json) go (default: RUNS/canary-report)",
    )
    p.add_argument(
        "--runs", type=Path, default=Path("runs"), help="run store the canary runs go to (default: runs)"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set train.steps=80 or --set canary.mfu_fail_pct=5",
    )
    p.add_argument(
        "--matrix",
        nargs="+",
        metavar="AXIS=V1,V2",
        help="kernel matrix instead of the gate: attention=..., experts=..., compile=off,on",
    )
    p.add_argument(
        "--repeats", type=int, default=2, help="matrix: runs per variant, interleaved (default: 2)"
    )
    p.add_argument(
        "--ab",
        nargs=2,
        metavar=("A", "B"),
        help="A/B canary instead of the gate (no history): two environments, each py:PATH (another "
        "Python interpreter, e.g. a venv's bin/python) or set:KEY=VALUE[,KEY=VALUE...] (this "
        "interpreter with config overrides; set: alone = the config unchanged); worker processes "
        "alternate in ABBA order (canary.ab_order); fails when the sign-test interval of the median "
        "per-pair B/A tokens/s ratio lies wholly below 1 - canary.ab_fail_pct/100 (exit 1). "
        "--inject slow:PCT slows B (a:slow:PCT slows A). Report: ab.md/ab.json in --report-dir",
    )


def run(args: argparse.Namespace) -> int:
    from trainer.cli import parse_overrides

    setup = load_setup(args.config, parse_overrides(args.set))
    if args.report_dir is None:
        args.report_dir = Path(args.runs) / "canary-report"
    if args.ab:
        clash = [
            flag
            for flag, on in (
                ("--matrix", args.matrix),
                ("--history", args.history),
                ("--record", args.record),
                ("--append", args.append),
                ("--accept", args.accept),
            )
            if on
        ]
        if clash:
            print(
                f"moeguard canary: --ab keeps no history and runs no matrix; drop {', '.join(clash)}",
                file=sys.stderr,
            )
            return EXIT_USAGE
        from guard.canary_ab import run_ab

        return run_ab(args, setup)
    if args.matrix:
        return run_matrix(args, setup)
    if args.history is None:
        print("moeguard canary: --history FILE is required (or use --matrix)", file=sys.stderr)
        return EXIT_USAGE
    if args.accept and not args.record:
        print("moeguard canary: --accept only makes sense with --record", file=sys.stderr)
        return EXIT_USAGE
    return run_canary(args, setup)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        raise SystemExit(_worker_main(sys.argv[2:]))
    from guard.cli import main

    raise SystemExit(main(["canary", *sys.argv[1:]]))
