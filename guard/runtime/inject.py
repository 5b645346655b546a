"""Drills inside any framework's loop: GuardedStep(inject=...) and $MOEGUARD_INJECT.

The same fault kinds and spec as `moeguard train --inject` (guard/core/inject.py), applied where a
GuardedStep can reach them, whoever runs the loop (torchtitan's Trainer, the transformers Trainer,
a plain loop), so a team drills its own paging before a real incident:

    at the first training forward of step S (a forward pre-hook on the guarded model)
        crash     SIGKILL                       hang      SIGSTOP for good (no ARG), or ARG s
        stall     ARG s in the `data` phase,              blocked as if in a collective
                  counted as the step's data wait
        collapse  the adapter's force_collapse(layer ARG) (torchtitan, transformers)
        badbatch  the token ids of every forward of step S become uniformly random (the model's
                  first embedding's vocabulary); labels are left as they were
    in GuardedStep.step (after backward, before the guard reads anything)
        gradspike / flip / nan   this rank's gradients x ARG / x ARG once per process / one NaN
        slowrank                 ARG s more every step from S on
        lrspike                  the LR x ARG for step S, the scheduler's LR put back after it

Gradients here are what the framework's backward left: under DDP/FSDP already reduced across ranks
(moeguard's own trainer injects before the reduction). Each injection is an `inject` event of the
step it fires at, on every rank (rank 0 writes the store), as in moeguard's trainer. `crash` and
`hang` fire in the first attempt of a torchrun job only (guard/core/inject.py).
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from guard.core import schema
from guard.core.events import Event
from guard.core.heartbeat import PHASE_DATA, PHASE_TRAIN
from guard.core.inject import PROCESS_FAULTS, Injection, from_env, parse_injections
from guard.core.tomlconf import ConfigError

FORWARD_FAULTS = ("crash", "hang", "stall", "collapse", "badbatch")
TOKEN_KWARGS = ("input_ids", "tokens", "input", "idx")  # how frameworks name a forward's token ids


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # this rank's part of a DTensor


def restart_count() -> int:
    """torchrun's restart of this job (0: the first attempt)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def resolve(inject: str | Iterable[str | Injection] | None) -> list[Injection]:
    """GuardedStep's `inject=`: specs (a list, or one comma-separated string) or Injections; None
    reads $MOEGUARD_INJECT."""
    if inject is None:
        return from_env()
    if isinstance(inject, str):
        return parse_injections(inject, flag="inject=")
    items = list(inject)
    return [i if isinstance(i, Injection) else parse_injections(str(i), flag="inject=")[0] for i in items]


class Injector:
    """The drills of one GuardedStep (`guarded`: its model, optimizer, rank, session, comm and
    step counter are read, never replaced)."""

    def __init__(
        self, injections: list[Injection], guarded: Any, *, collapse: Callable[[int], None] | None = None
    ) -> None:
        if restart_count() > 0:  # a torchrun restart: the process-killing drill already happened
            injections = [i for i in injections if i.kind not in PROCESS_FAULTS]
        self.planned = injections  # every rank's, for the events
        self.g = guarded
        rank = guarded.ranks.rank
        self.mine = [i for i in injections if i.rank in (None, rank)]
        self.collapse = collapse
        if any(i.kind == "collapse" for i in self.mine) and collapse is None:
            raise ConfigError(
                "inject collapse: this model's attachment cannot force a collapse (pass attach= from "
                "guard.integrations.torchtitan or guard.integrations.transformers)"
            )
        self.vocab = self._vocab(guarded.model) if any(i.kind == "badbatch" for i in self.mine) else 0
        self.fired: set[tuple[int, str]] = set()  # (step, kind) of the once-a-step forward faults
        self.flipped: set[int] = set()
        self._lrs: list[float] | None = None
        self._hook = None
        if any(i.kind in FORWARD_FAULTS for i in self.mine):
            self._hook = guarded.model.register_forward_pre_hook(self._before_forward, with_kwargs=True)

    @staticmethod
    def _vocab(model: nn.Module) -> int:
        emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        if emb is None:
            raise ConfigError("inject badbatch: the model has no nn.Embedding to draw garbage token ids from")
        return int(emb.num_embeddings)

    def _due(self, step: int, kind: str) -> Injection | None:
        return next((i for i in self.mine if i.step == step and i.kind == kind), None)

    # ---- at the first training forward of a step ---------------------------------------------
    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not module.training:  # an eval forward is not the step's
            return None
        step = self.g.step_idx
        for kind in ("crash", "hang", "stall", "collapse"):
            inj = self._due(step, kind)
            if inj is None or (step, kind) in self.fired:
                continue
            self.fired.add((step, kind))
            self._fire(inj)
        if self._due(step, "badbatch") is not None:
            return self._garbage(step, args, kwargs)
        return None

    def _fire(self, inj: Injection) -> None:
        if inj.kind == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        elif inj.kind == "hang" and inj.arg > 0:
            with self.g.comm.timed():  # as if blocked in a collective: the heartbeat pump beats on
                time.sleep(inj.arg)
        elif inj.kind == "hang":
            while True:  # SIGSTOP: every thread, so the exporter's beats stop too
                os.kill(os.getpid(), signal.SIGSTOP)
                time.sleep(3600)
        elif inj.kind == "stall":
            self.g.session.phase(PHASE_DATA)
            time.sleep(inj.arg)
            self.g.note_data_wait(inj.arg)
            self.g.session.phase(PHASE_TRAIN)
        elif inj.kind == "collapse":
            assert self.collapse is not None
            self.collapse(int(inj.arg))

    def _garbage(self, step: int, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        gen = torch.Generator().manual_seed(1_000_003 + step)

        def junk(t: torch.Tensor) -> torch.Tensor:
            x = torch.randint(0, self.vocab, t.shape, generator=gen, dtype=t.dtype)
            return x.to(t.device)

        def ids(t: Any) -> bool:
            return isinstance(t, torch.Tensor) and not t.is_floating_point() and t.dtype != torch.bool

        for name in TOKEN_KWARGS:
            if ids(kwargs.get(name)):
                return args, {**kwargs, name: junk(kwargs[name])}
        for j, a in enumerate(args):
            if ids(a):
                return (*args[:j], junk(a), *args[j + 1 :]), kwargs
        raise ConfigError("inject badbatch: the model's forward got no integer token ids to replace")

    # ---- in GuardedStep.step, after backward --------------------------------------------------
    def before_step(self, step: int) -> list[Event]:
        """Apply this step's gradient, LR and straggler faults; the step's `inject` events."""
        slow = [i for i in self.mine if i.kind == "slowrank" and i.step <= step]
        if slow:
            time.sleep(max(slow, key=lambda i: i.step).arg)
        grads = [p.grad for p in self.g.model.parameters() if p.grad is not None]
        if (inj := self._due(step, "gradspike")) is not None:
            _scale(grads, inj.arg)
        if (inj := self._due(step, "flip")) is not None and step not in self.flipped:
            self.flipped.add(step)
            _scale(grads, inj.arg)
        if self._due(step, "nan") is not None:
            last = next((g for g in reversed(grads) if _local(g).numel()), None)
            if last is not None:
                _local(last).view(-1)[0] = math.nan
        if (inj := self._due(step, "lrspike")) is not None:
            self._lrs = [float(g["lr"]) for g in self.g.optimizer.param_groups]
            for g in self.g.optimizer.param_groups:
                g["lr"] = float(g["lr"]) * inj.arg
        return [
            Event(step=step, kind=schema.EV_INJECT, detail={"injection": str(i)})
            for i in self.planned
            if i.step == step
        ]

    def after_step(self) -> None:
        """Put back the LRs an lrspike multiplied (the schedule goes on as planned)."""
        if self._lrs is not None:
            for g, lr in zip(self.g.optimizer.param_groups, self._lrs, strict=True):
                g["lr"] = lr
            self._lrs = None

    def meta(self) -> list[str]:
        return [str(i) for i in self.planned]

    def remove(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def _scale(grads: list[torch.Tensor], factor: float) -> None:
    local = [_local(g) for g in grads]
    if local:
        torch._foreach_mul_(local, factor)
