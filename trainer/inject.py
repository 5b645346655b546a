"""Fault injection for drills: `moeguard train --inject KIND@STEP[:ARG]` (repeatable).

    gradspike@S:ARG  scale every gradient by ARG (default 100) after backward
    lrspike@S:ARG    multiply the LR by ARG (default 100) for one step
    nan@S            one non-finite gradient element (last block)
    badbatch@S       the batch at S is uniformly random garbage tokens
    collapse@S:ARG   push MoE layer ARG's router towards expert 0 from S on (a persistent
                     +8 logit offset, like a router whose weights drifted)
    stall@S:ARG      the data loader sleeps ARG seconds (default 6) before batch S
    crash@S          the process dies at S (SIGKILL: nothing is flushed, like a node loss)
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import torch

from guard import schema
from guard.tomlconf import ConfigError

_DEFAULT_ARG = {"gradspike": 100.0, "lrspike": 100.0, "nan": 0.0, "badbatch": 0.0, "collapse": 0.0,
                "stall": 6.0, "crash": 0.0}  # fmt: skip
COLLAPSE_LOGIT_OFFSET = 8.0


@dataclass(frozen=True, slots=True)
class Injection:
    kind: str
    step: int
    arg: float

    def __str__(self) -> str:
        return f"{self.kind}@{self.step}:{self.arg:g}"


def parse_injection(spec: str) -> Injection:
    """'gradspike@120:50' -> Injection('gradspike', 120, 50.0); errors name the bad part."""
    kind, sep, rest = spec.partition("@")
    if not sep:
        raise ConfigError(f"--inject {spec!r}: expected KIND@STEP[:ARG], e.g. gradspike@100:50")
    if kind not in schema.INJECT_KINDS:
        raise ConfigError(f"--inject {spec!r}: unknown kind {kind!r}; kinds: {', '.join(schema.INJECT_KINDS)}")
    step_s, _, arg_s = rest.partition(":")
    try:
        step = int(step_s)
    except ValueError:
        raise ConfigError(f"--inject {spec!r}: STEP {step_s!r} is not an integer") from None
    if step < 0:
        raise ConfigError(f"--inject {spec!r}: STEP must be >= 0")
    try:
        arg = float(arg_s) if arg_s else _DEFAULT_ARG[kind]
    except ValueError:
        raise ConfigError(f"--inject {spec!r}: ARG {arg_s!r} is not a number") from None
    return Injection(kind, step, arg)


class Injector:
    """Applies the injections due at each step. Every injection is also recorded as an event."""

    def __init__(self, injections: list[Injection]) -> None:
        self.by_step: dict[int, list[Injection]] = {}
        for inj in injections:
            self.by_step.setdefault(inj.step, []).append(inj)

    def due(self, step: int, kind: str) -> Injection | None:
        return next((i for i in self.by_step.get(step, []) if i.kind == kind), None)

    def at(self, step: int) -> list[Injection]:
        return self.by_step.get(step, [])

    # ---- the faults ---------------------------------------------------------------------
    @staticmethod
    def garbage_batch(batch: torch.Tensor, vocab_size: int, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1_000_003 + step)
        return torch.randint(0, vocab_size, batch.shape, generator=g, dtype=batch.dtype)

    @staticmethod
    def scale_grads(params: list[torch.nn.Parameter], factor: float) -> None:
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor)

    @staticmethod
    def poison_grad(model: torch.nn.Module) -> None:
        last = list(model.blocks)[-1]
        for p in last.parameters():
            if p.grad is not None:
                p.grad.view(-1)[0] = float("nan")
                return

    @staticmethod
    def collapse(model: torch.nn.Module, layer: int) -> None:
        moe = dict(model.moe_layers())
        if layer not in moe:
            raise ConfigError(f"--inject collapse: layer {layer} is not an MoE layer; MoE layers: {sorted(moe)}")
        moe[layer].router.logit_offset_E[0] += COLLAPSE_LOGIT_OFFSET

    @staticmethod
    def crash() -> None:
        os.kill(os.getpid(), signal.SIGKILL)
