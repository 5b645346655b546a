"""A torchtitan config registry that trains on a CPU with no download: the tests' and benches' job.

    torchrun --nproc_per_node 2 -m guard.integrations.torchtitan \
        --module bench.common.torchtitan_registry --config tiny_moe --training.steps 40

torchtitan 0.3.0 picks a job with `--module M --config F` (F() in M's config registry returns a
Trainer.Config). These return torchtitan's own Trainer.Config over torchtitan's DeepSeek-V3
(bench/common/torchtitan_model.py: `small`, or torchtitan's own `debugmodel`), with a byte tokenizer and
random windows of this Python's standard library source (no hub), checkpointing on, FSDP over
every rank. Real users pass torchtitan's own registries (`--module deepseek_v3 ...`).

Drills (tests): $MOEGUARD_TT_FAULTS, comma-separated KIND@STEP[:ARG][/rRANK] (guard/core/inject.py's
spec and parser) with STEP the guard's 0-based step, injected inside torchtitan's loss, so before the
cross-rank reduction: `gradspike@S:X` multiplies the loss (and so every gradient) by X on that rank,
`nan` makes it NaN, `hang@S:SECONDS` sleeps inside the step (its peers wait in the next collective).
Users drill with the launcher's `--inject` (every kind, applied by GuardedStep: guard/runtime/inject.py).

Writes docs/BENCHMARKS.md: no section of its own; the registry that torchtitan's Trainer loads in
Overhead › Guard overhead inside torchtitan's Trainer, 2 ranks, streaming (debugmodel).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.components.validate import Validator
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.models.deepseek_v3 import parallelize_deepseekv3
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.trainer import Trainer

from bench.common.torchtitan_model import SMALL_VOCAB, model_config
from guard.core.inject import parse_injections

ENV_FAULTS = "MOEGUARD_TT_FAULTS"
# a folder: each rank writes there, at every applied step, a digest of its parameters and
# torchtitan's own expert counters as they were before the update (what the tests compare)
ENV_PROBE_DIR = "MOEGUARD_TT_PROBE_DIR"
# a folder: each rank appends the perf_counter at the start of every step's first forward (the
# overhead bench's step times, taken the same way with and without the guard)
ENV_TIMING_DIR = "MOEGUARD_TT_TIMING_DIR"
CORPUS_BYTES = 1 << 20
STEP = [0]  # the guard step the current forward belongs to (FaultyLoss keeps it)


LOSS_FAULTS = ("gradspike", "nan", "hang")


def parse_faults(text: str, rank: int) -> dict[int, tuple[str, float]]:
    """{step: (kind, arg)} of the faults for `rank` in $MOEGUARD_TT_FAULTS."""
    out: dict[int, tuple[str, float]] = {}
    for inj in parse_injections(text, flag=f"${ENV_FAULTS}"):
        if inj.kind not in LOSS_FAULTS:
            raise ValueError(f"${ENV_FAULTS} {str(inj)!r}: kind must be one of {', '.join(LOSS_FAULTS)}")
        if inj.rank in (None, rank):
            out[inj.step] = (inj.kind, inj.arg)
    return out


class Bytes(BaseTokenizer):
    """Bytes are the vocabulary (no hub download)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Any, tokenizer_path: str | None = None) -> None:
        super().__init__()

    def encode(self, s: str, *a: Any, **k: Any) -> list[int]:
        return list(s.encode())

    def decode(self, ids: list[int], *a: Any, **k: Any) -> str:
        return bytes(ids).decode(errors="replace")

    def get_vocab_size(self) -> int:
        return SMALL_VOCAB


class Windows(BaseDataLoader):
    """Random windows of the standard library's source, a stream per data-parallel rank; its
    position is in torchtitan's checkpoint (a resume continues the same stream)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        seed: int = 0
        infinite: bool = True  # torchtitan's validator sets it; the stream never ends (give it steps > 0)

    def __init__(
        self, config: Config, *, seq_len: int, local_batch_size: int, dp_rank: int = 0, **_: Any
    ) -> None:
        from trainer.data import stdlib_corpus

        self.data = torch.from_numpy(stdlib_corpus(CORPUS_BYTES).astype(np.int64))
        self.seq, self.batch, self.key = seq_len, local_batch_size, f"dp_rank_{dp_rank}"
        self.rng = np.random.default_rng([config.seed, dp_rank])

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            starts = self.rng.integers(0, len(self.data) - self.seq - 1, self.batch)
            x = torch.stack([self.data[s : s + self.seq + 1] for s in starts])
            yield {"input": x[:, :-1]}, x[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {self.key: self.rng.bit_generator.state}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if self.key in sd:
            self.rng.bit_generator.state = sd[self.key]


class FaultyLoss(CrossEntropyLoss):
    """torchtitan's cross entropy, with the drills of $MOEGUARD_TT_FAULTS (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CrossEntropyLoss.Config):
        grad_accum: int = 1

    def __init__(self, config: Config, **kw: Any) -> None:
        super().__init__(config, **kw)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.faults = parse_faults(os.environ.get(ENV_FAULTS, ""), rank)
        self.calls, self.grad_accum = 0, max(1, config.grad_accum)
        timing = os.environ.get(ENV_TIMING_DIR)
        self.times = open(os.path.join(timing, f"times-r{rank}.txt"), "a", buffering=1) if timing else None

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor, *a: Any, **k: Any) -> Any:
        loss, extra = super().__call__(pred, labels, *a, **k)
        step, self.calls = self.calls // self.grad_accum, self.calls + 1
        STEP[0] = step
        if self.times is not None and (self.calls - 1) % self.grad_accum == 0:
            self.times.write(f"{step} {time.perf_counter():.6f}\n")
        kind, arg = self.faults.get(step, ("", 0.0))
        if kind == "gradspike":
            loss = loss * arg
        elif kind == "nan":
            loss = loss * float("nan")
        elif kind == "hang" and self.calls % self.grad_accum == 1 % self.grad_accum:
            time.sleep(arg)
        return loss, extra


def job(model: str, *, steps: int, batch: int, seq: int, interval: int) -> Trainer.Config:
    spec = ModelSpec(
        name="deepseek_v3",
        flavor=model,
        model=model_config(model, max_seq_len=seq),
        parallelize_fn=parallelize_deepseekv3,
        pipelining_fn=None,
        post_optimizer_build_fn=_balancing_hook(),
        state_dict_adapter=None,
    )
    optimizer = default_adamw(lr=1e-3)
    optimizer.implementation = "foreach"
    return Trainer.Config(
        model_spec=spec,
        hf_assets_path=".",
        dump_folder="./outputs",
        tokenizer=Bytes.Config(),
        dataloader=Windows.Config(),
        loss=FaultyLoss.Config(global_vocab_size=spec.model.vocab_size),
        optimizer=optimizer,
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=10),
        metrics=MetricsProcessor.Config(log_freq=10),
        training=TrainingConfig(
            local_batch_size=batch,
            seq_len=seq,
            steps=steps,
            disable_cuda_graphs=True,
            mixed_precision_param="float32",
            max_norm=1.0,
        ),
        # FSDP2 over DTensor model-parallel axes only: torchtitan's "spmd_types" default wants every
        # parameter a DTensor on the full mesh, which its CPU attention swap does not give
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        checkpoint=CheckpointManager.Config(enable=True, interval=interval, last_save_model_only=False),
        # off unless --validator.enable: then stdlib windows of another seed (no hub download), a
        # fixed number of batches (the stream never ends: steps -1 would not return)
        validator=Validator.Config(steps=4, freq=20, dataloader=Windows.Config(seed=1)),
        activation_checkpoint=None,
    )


def _balancing_hook() -> Any:
    """torchtitan's own expert-bias hook, with the probe hooks of $MOEGUARD_TT_PROBE_DIR first."""
    from torchtitan.components.optimizer import register_moe_load_balancing_hook

    def build(optimizers: Any, model_parts: list[torch.nn.Module], parallel_dims: Any) -> None:
        if os.environ.get(ENV_PROBE_DIR):
            _register_probe(optimizers, model_parts, os.environ[ENV_PROBE_DIR])
        register_moe_load_balancing_hook(optimizers, model_parts, parallel_dims)

    return build


def _register_probe(optimizers: Any, model_parts: list[torch.nn.Module], out: str) -> None:
    import hashlib
    import json

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    os.makedirs(out, exist_ok=True)
    model = model_parts[0]
    moes = {i: b.moe for i, b in enumerate(model.layers.values()) if getattr(b, "moe_enabled", False)}

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    def before(*_: Any) -> None:  # before torchtitan's hook all-reduces and zeroes the counters
        row = {"step": STEP[0], "counts": {i: local(m.tokens_per_expert_E).tolist() for i, m in moes.items()}}
        with open(os.path.join(out, f"counts-r{rank}.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")

    def after(*_: Any) -> None:
        h = hashlib.sha256()
        for name, p in sorted(model.named_parameters()):
            h.update(name.encode())
            h.update(local(p).detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        with open(os.path.join(out, f"digest-r{rank}.txt"), "w") as f:
            f.write(f"{STEP[0]} {h.hexdigest()}\n")

    optimizers.register_step_pre_hook(before)
    optimizers.register_step_post_hook(after)


def tiny_moe() -> Trainer.Config:
    """bench/common/torchtitan_model.py's small DeepSeek-V3 (dim 64, 3 MoE layers of 8 experts)."""
    return job("small", steps=60, batch=8, seq=64, interval=20)


def debugmodel_cpu() -> Trainer.Config:
    """torchtitan's own DeepSeek-V3 debugmodel (33 M parameters) at 256 tokens a rank a step."""
    return job("debugmodel", steps=40, batch=1, seq=256, interval=1000)
