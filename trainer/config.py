"""The training config: one TOML file, one typed dataclass per table, validated on load.

[model]      trainer.model_config.ModelConfig
[data]       trainer.data_config.DataConfig
[optim]      OptimConfig
[train]      TrainLoopConfig
[telemetry]  TelemetryConfig
[guard]      guard.core.config.GuardConfig
[store]      guard.store.policy.StoreConfig (retention, rollups, compaction: docs/long-runs.md)
name, tags   at the top level: the run's name (its folder) and its tags (guard/core/tags.py)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from guard.core.config import GuardConfig
from guard.core.tags import clean_tags
from guard.core.tomlconf import ConfigError, check, check_choice, from_dict, load_toml
from guard.store.policy import StoreConfig
from guard.wire.batch import valid_run_id
from trainer.data_config import DataConfig
from trainer.model_config import ModelConfig

MAX_NAME_LEN = 100  # room for the "-<timestamp>" a default run folder adds (a run id is <= 128)


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 50
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping

    def __post_init__(self) -> None:
        for key in (
            "lr",
            "weight_decay",
            "eps",
            "grad_clip",
        ):  # nan and inf pass every comparison below or none
            check(
                math.isfinite(getattr(self, key)),
                f"optim.{key}",
                getattr(self, key),
                "must be a finite number",
            )
        check(self.lr > 0, "optim.lr", self.lr, "must be > 0")
        check(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        check(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, "must be >= 0")
        check(0 <= self.beta1 < 1, "optim.beta1", self.beta1, "must be in [0, 1)")
        check(0 <= self.beta2 < 1, "optim.beta2", self.beta2, "must be in [0, 1)")
        check(self.grad_clip >= 0, "optim.grad_clip", self.grad_clip, "must be >= 0")


@dataclass(kw_only=True, slots=True)
class TrainLoopConfig:
    steps: int = 600
    seed: int = 0
    grad_accum: int = 1  # micro-batches per step
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (bf16 autocast on GPU, fp32 on CPU) | fp32 | bf16
    compile: bool = False
    checkpoint_every: int = 200  # steps between on-disk checkpoints (0: only at the end)
    keep_checkpoints: int = 2
    threads: int = 0  # CPU threads for torch (0: torch's default)
    deterministic: bool = True  # torch.use_deterministic_algorithms on CPU
    # Multi-rank (torchrun): "ddp" replicates the model and averages gradients with one coalesced
    # all-reduce per step; "fsdp" shards parameters, gradients and optimizer state with FSDP2
    # (fully_shard per block, then the root). "none" refuses WORLD_SIZE > 1. See trainer/distributed.py.
    parallel: str = "ddp"
    # CPython's cyclic GC at step boundaries (trainer/step_gc.py; torchtitan's training.gc_freq,
    # Megatron's --manual-gc): automatic collections off for the run, the young generations
    # collected every gc_every steps and everything at each checkpoint, so the ranks pause at the
    # same step instead of one rank's pause stalling the others. 0: CPython's automatic GC.
    gc_every: int = 50

    def __post_init__(self) -> None:
        check(self.steps >= 1, "train.steps", self.steps, "must be >= 1")
        check(self.gc_every >= 0, "train.gc_every", self.gc_every, "must be >= 0 (0: CPython's automatic GC)")
        check(self.grad_accum >= 1, "train.grad_accum", self.grad_accum, "must be >= 1")
        check_choice("train.device", self.device, ("auto", "cpu", "cuda"))
        check_choice("train.dtype", self.dtype, ("auto", "fp32", "bf16"))
        check_choice("train.parallel", self.parallel, ("ddp", "fsdp", "none"))
        check(self.checkpoint_every >= 0, "train.checkpoint_every", self.checkpoint_every, "must be >= 0")
        check(self.keep_checkpoints >= 1, "train.keep_checkpoints", self.keep_checkpoints, "must be >= 1")


@dataclass(kw_only=True, slots=True)
class TelemetryConfig:
    enabled: bool = True  # False: no probe at all (the benchmark's baseline)
    dead_window: int = 50  # steps without a token before an expert counts as dead
    flush_every: int = 50  # run-store chunk size in steps
    collector: str = ""  # collector URL ("" = env MOEGUARD_COLLECTOR or none)
    otlp_endpoint: str = ""  # OTLP/HTTP receiver, base or /v1/metrics URL ("" = off; guard/runtime/otel.py)
    straggler_every: int = 20  # multi-rank: per-rank timing gathered every N steps
    straggler_threshold: float = 0.75
    profile: bool = True  # a short torch.profiler window each run (TensorBoard traces)
    profile_wait: int = 5
    profile_warmup: int = 2
    profile_active: int = 2

    def __post_init__(self) -> None:
        check(self.dead_window >= 1, "telemetry.dead_window", self.dead_window, "must be >= 1")
        check(self.flush_every >= 1, "telemetry.flush_every", self.flush_every, "must be >= 1")
        check(
            0 < self.straggler_threshold < 1,
            "telemetry.straggler_threshold",
            self.straggler_threshold,
            "must be in (0, 1)",
        )
        otlp = self.otlp_endpoint
        check(
            not otlp or otlp.startswith(("http://", "https://")),
            "telemetry.otlp_endpoint",
            otlp,
            "must be http(s)",
        )


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    name: str = "run"
    # meta.json "tags": what the Runs page filters by (`moeguard train --tag X` adds to them)
    tags: list[str] = field(default_factory=list)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    store: StoreConfig = field(default_factory=StoreConfig)

    def __post_init__(self) -> None:
        check(
            isinstance(self.name, str) and valid_run_id(self.name) and len(self.name) <= MAX_NAME_LEN,
            "name",
            self.name,
            f"must be a run id: letters, digits, '.', '_' or '-', starting with a letter or digit, "
            f"at most {MAX_NAME_LEN} characters (it names the run's folder and its id on the collector)",
        )
        try:
            self.tags = clean_tags(self.tags)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        check(
            self.data.seq_len <= self.model.max_seq_len,
            "data.seq_len",
            self.data.seq_len,
            f"must be <= model.max_seq_len ({self.model.max_seq_len})",
        )


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    data = load_toml(path) if path is not None else {}
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return from_dict(TrainConfig, data)
