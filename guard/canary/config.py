"""The canary's config: a training config plus a [canary] table, loaded, overridden and hashed.

guard does not know the training config's schema: a `TrainerSide` (trainer/canary_cli.py builds
it) hands in the validator, the `--set` parser and the worker command; guard never imports trainer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from guard.core.tomlconf import ConfigError, check, check_choice, from_dict, load_toml
from guard.resources import resource

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = resource("configs", "canary.toml")

EXIT_PASS, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
TIMING_CPU, TIMING_WALL = "cpu", "wall"

# Bumped when what a measurement means changes (window, reference, formulas, page policy): old
# baselines then stop matching (the config hash includes it) instead of being compared like with unlike.
MEASURE_VERSION = 3  # 3: the reference is numpy's matmul (was torch's)


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
    # bench/canary/canary_power.py saw 5 false alarms in 10 clean runs (docs/BENCHMARKS.md, canary).
    baseline_min_span_h: float = 0.0
    # ... but a baseline that spans less does not disarm the MFU gate: it widens the fail line to
    # max(mfu_fail_pct, min(young_fail_cap_pct, max(young_spread_factor x the baseline's own spread,
    # young_fail_floor_pct))) (see young_fail_line): a regression far beyond the host's drift fails
    # from the first day.
    young_spread_factor: float = 3.0
    young_fail_floor_pct: float = 10.0
    young_fail_cap_pct: float = 20.0
    # `--ab A B` (guard/canary/ab.py): pairs of worker processes, one per environment, in ABBA (or
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


@dataclass(frozen=True, slots=True)
class TrainerSide:
    """What the canary needs from the training code (trainer/canary_cli.py builds it)."""

    build_config: Callable[[dict[str, Any]], Any]  # raw TOML tables -> validated training config
    parse_overrides: Callable[[list[str]], dict[str, Any]]  # `--set KEY=VALUE` items -> {dotted: value}
    worker: tuple[str, ...]  # interpreter arguments of the measuring worker; SPEC and OUT are appended


@dataclass(kw_only=True, slots=True)
class Setup:
    """A loaded canary config: the training config's raw tables plus the canary settings."""

    path: Path
    train: dict[str, Any]  # raw TOML tables of the training config, overrides applied
    canary: CanaryConfig
    trainer: TrainerSide
    overrides: dict[str, Any] = field(default_factory=dict)

    def train_config(self, extra: dict[str, Any] | None = None) -> Any:
        """The validated training config, with `extra` overrides (a matrix variant, an A/B side)."""
        data = json.loads(json.dumps(self.train))
        apply_overrides(data, extra or {})
        return self.trainer.build_config(data)

    def config_hash(self, extra: dict[str, Any] | None = None) -> str:
        """Hash of what the config file (plus overrides) says and of the canary's measurement
        settings (not its gates, not the run name or telemetry endpoints). The file's text as
        parsed, not the dataclasses with their defaults: a new config field elsewhere in the
        trainer must not orphan every baseline, and a changed default that slows the run is a
        regression for the canary to report, not a new configuration."""
        self.train_config(extra)  # validate
        data = json.loads(json.dumps(self.train))
        apply_overrides(data, extra or {})
        data.pop("name", None)
        for k in ("collector", "otlp_endpoint"):
            data.get("telemetry", {}).pop(k, None)
        blob = json.dumps({"train": data, "canary": self.canary.measure_key()}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:10]

    def label(self, extra: dict[str, Any] | None = None) -> str:
        ov = {**self.overrides, **(extra or {})}
        sets = ",".join(f"{k}={v}" for k, v in sorted(ov.items()))
        return f"{self.path.name}[{sets}]" if sets else self.path.name


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> None:
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {dotted!r}: {p!r} is not a table")
        node[leaf] = value


def load_setup(path: str | Path, overrides: dict[str, Any] | None, trainer: TrainerSide) -> Setup:
    """Read the canary TOML, split off [canary], apply dotted overrides and validate both parts."""
    data = load_toml(path)
    canary_raw = data.pop("canary", {})
    overrides = dict(overrides or {})
    canary_ov = {k.removeprefix("canary."): v for k, v in overrides.items() if k.startswith("canary.")}
    train_ov = {k: v for k, v in overrides.items() if not k.startswith("canary.")}
    if not isinstance(canary_raw, dict):
        raise ConfigError("canary must be a table")
    canary = from_dict(CanaryConfig, {**canary_raw, **canary_ov}, prefix="canary.")
    apply_overrides(data, train_ov)
    setup = Setup(path=Path(path), train=data, canary=canary, trainer=trainer, overrides=train_ov)
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


# [canary] keys only the parent reads: not passed to workers, so a worker of an older moeguard (`--ab
# py:PATH` with that venv's own install) does not reject keys it does not know.
PARENT_ONLY_KEYS = ("young_", "ab_")


def worker_overrides(setup: Setup) -> dict[str, Any]:
    """The worker re-reads the TOML: the overrides applied here, the [canary] values included."""
    canary = {
        f"canary.{f.name}": getattr(setup.canary, f.name)
        for f in dataclasses.fields(CanaryConfig)
        if not f.name.startswith(PARENT_ONLY_KEYS)
    }
    return {**setup.overrides, **canary}
