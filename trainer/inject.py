"""Fault injection for drills: `moeguard train --inject KIND@STEP[:ARG][/rRANK]` (repeatable).

    gradspike@S:ARG  scale every gradient by ARG (default 100) after backward
    lrspike@S:ARG    multiply the LR by ARG (default 100) for one step
    nan@S            one non-finite gradient element (last block)
    badbatch@S       the batch at S is uniformly random garbage tokens
    collapse@S:ARG   push MoE layer ARG's router towards expert 0 from S on (a persistent
                     +8 logit offset, like a router whose weights drifted)
    stall@S:ARG      the data loader sleeps ARG seconds (default 6) before batch S
    crash@S          the process dies at S (SIGKILL: nothing is flushed, like a node loss)
    slowrank@S:ARG   from S on, every step computes ARG seconds longer (default 0.05): a straggler
    hang@S           the process stops making progress at S (sleeps forever, outside any collective,
                     so its heartbeat stops too: HeartbeatLost)
    hang@S:ARG       step S blocks for ARG seconds as if inside a hung collective: the rank's
                     heartbeat goes on (trainer.distributed.HeartbeatPump) while its step does not
                     advance (RunStuck), then the run carries on (RunStuck resolves)

`crash` and `hang` fire in the first attempt of a torchrun job only: a job restarted by
`torchrun --max-restarts` replays the same command line, and a drill's node loss happens once.
The other faults replay when their step is re-run, like the data or hardware that caused them.

Multi-rank: a `/rRANK` suffix (or `@rankRANK`) targets one rank, e.g. `nan@45/r1`,
`gradspike@45:50@rank1`; without it every rank injects. Gradient faults are injected into the
rank's local gradients before the cross-rank reduction, as a real faulty rank would produce them.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass

import torch

from guard.core import schema
from guard.core.tomlconf import ConfigError

_DEFAULT_ARG = {
    "gradspike": 100.0,
    "lrspike": 100.0,
    "nan": 0.0,
    "badbatch": 0.0,
    "collapse": 0.0,
    "stall": 6.0,
    "crash": 0.0,
    "slowrank": 0.05,
    "hang": 0.0,
}
COLLAPSE_LOGIT_OFFSET = 8.0
# What ARG means for each kind (`moeguard train --help` lists these; every kind has a line).
INJECT_HELP = {
    "gradspike": "ARG = factor every gradient is scaled by after backward (default 100)",
    "lrspike": "ARG = factor the LR is multiplied by, for that one step (default 100)",
    "nan": "no ARG: one gradient element of the last block becomes NaN",
    "badbatch": "no ARG: the batch at STEP is uniformly random garbage tokens",
    "collapse": "ARG = MoE layer whose router is pushed towards expert 0 from STEP on (default 0)",
    "stall": "ARG = seconds the data loader sleeps before batch STEP (default 6)",
    "crash": "no ARG: the process SIGKILLs itself at STEP, like a node loss (first torchrun attempt only)",
    "slowrank": "ARG = extra seconds every step computes from STEP on (default 0.05): a straggler",
    "hang": "no ARG: the process stops making progress at STEP for good, its heartbeat too (first torchrun "
    "attempt only); ARG = seconds STEP blocks as if in a hung collective while the heartbeat goes on, "
    "then the run carries on (a RunStuck drill)",
}
_RANK_RE = re.compile(r"(?:/r|@rank)(\d+)$")


@dataclass(frozen=True, slots=True)
class Injection:
    kind: str
    step: int
    arg: float
    rank: int | None = None  # None: every rank

    def __str__(self) -> str:
        return f"{self.kind}@{self.step}:{self.arg:g}" + (f"/r{self.rank}" if self.rank is not None else "")


def parse_injection(spec: str) -> Injection:
    """'gradspike@120:50' -> Injection('gradspike', 120, 50.0); 'nan@45/r1' targets rank 1.
    Errors name the bad part."""
    rank = None
    body = spec
    if m := _RANK_RE.search(spec):
        rank, body = int(m.group(1)), spec[: m.start()]
    kind, sep, rest = body.partition("@")
    if not sep:
        raise ConfigError(f"--inject {spec!r}: expected KIND@STEP[:ARG][/rRANK], e.g. gradspike@100:50")
    if kind not in schema.INJECT_KINDS:
        raise ConfigError(
            f"--inject {spec!r}: unknown kind {kind!r}; kinds: {', '.join(schema.INJECT_KINDS)}"
        )
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
    return Injection(kind, step, arg, rank)


def _local(g: torch.Tensor) -> torch.Tensor:
    """The rank-local part of a gradient (an FSDP2 DTensor's shard, or the tensor itself)."""
    return g.to_local() if hasattr(g, "to_local") else g


class Injector:
    """Applies the injections due at each step on this rank. Each one is also recorded as an event."""

    def __init__(self, injections: list[Injection], rank: int = 0, attempt: int = 0) -> None:
        self.by_step: dict[int, list[Injection]] = {}
        if attempt > 0:  # a torchrun restart: the process-killing drill already happened
            injections = [i for i in injections if i.kind not in ("crash", "hang")]
        self.slow = sorted(
            (i for i in injections if i.kind == "slowrank" and i.rank in (None, rank)), key=lambda i: i.step
        )
        for inj in injections:
            if inj.rank in (None, rank):
                self.by_step.setdefault(inj.step, []).append(inj)

    def due(self, step: int, kind: str) -> Injection | None:
        return next((i for i in self.by_step.get(step, []) if i.kind == kind), None)

    def at(self, step: int) -> list[Injection]:
        return self.by_step.get(step, [])

    def slow_s(self, step: int) -> float:
        """Extra compute seconds this rank spends at `step` (the latest slowrank in force)."""
        active = [i for i in self.slow if i.step <= step]
        return active[-1].arg if active else 0.0

    # ---- the faults ---------------------------------------------------------------------
    @staticmethod
    def garbage_batch(batch: torch.Tensor, vocab_size: int, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1_000_003 + step)
        return torch.randint(0, vocab_size, batch.shape, generator=g, dtype=batch.dtype)

    @staticmethod
    def scale_grads(params: list[torch.nn.Parameter], factor: float) -> None:
        grads = [_local(p.grad) for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor)

    @staticmethod
    def poison_grad(model: torch.nn.Module) -> None:
        last = list(model.blocks)[-1]
        for p in last.parameters():
            if p.grad is not None and _local(p.grad).numel():
                _local(p.grad).view(-1)[0] = float("nan")
                return

    @staticmethod
    def collapse(model: torch.nn.Module, layer: int) -> None:
        moe = dict(model.moe_layers())
        if layer not in moe:
            raise ConfigError(
                f"--inject collapse: layer {layer} is not an MoE layer; MoE layers: {sorted(moe)}"
            )
        moe[layer].router.logit_offset_E[0] += COLLAPSE_LOGIT_OFFSET

    @staticmethod
    def crash() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    @staticmethod
    def hang() -> None:
        while True:  # a wedged rank: alive, holding its sockets, making no progress
            time.sleep(3600)

    @staticmethod
    def block(seconds: float) -> None:
        """A hung collective that comes back after `seconds` (the caller marks it as one)."""
        time.sleep(seconds)
