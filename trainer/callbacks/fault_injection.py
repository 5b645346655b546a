"""Fault injection for drills (`moeguard train --inject KIND@STEP[:ARG][/rRANK]`, the kinds and
their ARG in trainer/inject.py): each fault at its place in the step, each one recorded as an
`inject` event of the step it fired at.

    pre_step         crash (SIGKILL, like a node loss), hang (forever, or ARG s inside a collective)
    pre_load_batch   stall (the data loader sleeps ARG s before the batch)
    post_load_batch  badbatch (uniformly random garbage tokens)
    post_backward    slowrank (sleeps ARG s more every step), gradspike, nan, collapse, flip: into
                     this rank's gradients and router, before the cross-rank reduction spreads them;
                     flip once per process (a recompute of the step, guard.rerun, is clean)
    adjust_lr        lrspike (the LR x ARG for one step)

The plain loop (telemetry off, the overhead benchmark's baseline) takes only the data faults, as
it always has: `data_faults_only`.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch

from guard.core import schema
from guard.core.events import Event
from guard.core.tomlconf import ConfigError
from trainer.callbacks.callback import Callback
from trainer.inject import PROCESS_FAULTS, Injection

COLLAPSE_LOGIT_OFFSET = 8.0


class FaultInjection(Callback):
    name = "fault_injection"

    def __init__(
        self, injections: list[Injection], *, rank: int = 0, attempt: int = 0, data_faults_only: bool = False
    ) -> None:
        if attempt > 0:  # a torchrun restart: the process-killing drill already happened
            injections = [i for i in injections if i.kind not in PROCESS_FAULTS]
        mine = [i for i in injections if i.rank in (None, rank)]
        self.slow = sorted((i for i in mine if i.kind == "slowrank"), key=lambda i: i.step)
        self.by_step: dict[int, list[Injection]] = {}
        for inj in mine:
            self.by_step.setdefault(inj.step, []).append(inj)
        self.data_faults_only = data_faults_only
        self.flipped: set[int] = set()  # steps flipped: a transient fault happens once, not in a recompute

    def due(self, step: int, kind: str) -> Injection | None:
        return next((i for i in self.by_step.get(step, []) if i.kind == kind), None)

    def at(self, step: int) -> list[Injection]:
        return self.by_step.get(step, [])

    def slow_s(self, step: int) -> float:
        """Extra compute seconds this rank spends at `step` (the latest slowrank in force)."""
        active = [i for i in self.slow if i.step <= step]
        return active[-1].arg if active else 0.0

    # ---- hooks ----------------------------------------------------------------------------
    def pre_step(self, step: int) -> None:
        if self.data_faults_only:
            return
        for inj in self.at(step):
            if inj.kind == "crash":
                crash()
            if inj.kind == "hang" and inj.arg > 0:
                with self.trainer.comm.timed():  # as if blocked in a collective: the HeartbeatPump beats on
                    time.sleep(inj.arg)
            elif inj.kind == "hang":
                hang()

    def pre_load_batch(self, step: int) -> None:
        if (inj := self.due(step, "stall")) is not None:
            self.trainer.data.stall_next_s = inj.arg

    def post_load_batch(self, step: int, batches: list[torch.Tensor]) -> None:
        if self.due(step, "badbatch") is not None:
            vocab = self.trainer.cfg.model.vocab_size
            batches[:] = [garbage_batch(b, vocab, step) for b in batches]

    def post_backward(self, step: int) -> None:
        if self.data_faults_only:
            return
        if (slow := self.slow_s(step)) > 0:
            time.sleep(slow)  # a slow device: more compute time on this rank only
        if (inj := self.due(step, "gradspike")) is not None:
            scale_grads(self.trainer.params, inj.arg)
        if self.due(step, "nan") is not None:
            poison_grad(self.trainer.model)
        if (inj := self.due(step, "collapse")) is not None:
            collapse(self.trainer.model, int(inj.arg))
        if (inj := self.due(step, "flip")) is not None and step not in self.flipped:
            self.flipped.add(step)
            scale_grads(self.trainer.params, inj.arg)

    def adjust_lr(self, step: int, lr: float) -> float:
        if (inj := self.due(step, "lrspike")) is not None:
            return lr * inj.arg
        return lr

    def pre_record(self, step: int, events: list[Event]) -> None:
        for inj in self.at(step):
            events.insert(0, Event(step=step, kind=schema.EV_INJECT, detail={"injection": str(inj)}))

    def meta(self) -> dict[str, Any]:
        return {"injections": [str(i) for s in self.by_step.values() for i in s]}


# ---- the faults ----------------------------------------------------------------------------
def _local(g: torch.Tensor) -> torch.Tensor:
    """The rank-local part of a gradient (an FSDP2 DTensor's shard, or the tensor itself)."""
    return g.to_local() if hasattr(g, "to_local") else g


def garbage_batch(batch: torch.Tensor, vocab_size: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1_000_003 + step)
    return torch.randint(0, vocab_size, batch.shape, generator=g, dtype=batch.dtype)


def scale_grads(params: list[torch.nn.Parameter], factor: float) -> None:
    grads = [_local(p.grad) for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, factor)


def poison_grad(model: torch.nn.Module) -> None:
    last = list(model.blocks)[-1]
    for p in last.parameters():
        if p.grad is not None and _local(p.grad).numel():
            _local(p.grad).view(-1)[0] = float("nan")
            return


def collapse(model: torch.nn.Module, layer: int) -> None:
    moe = dict(model.moe_layers())
    if layer not in moe:
        raise ConfigError(f"--inject collapse: layer {layer} is not an MoE layer; MoE layers: {sorted(moe)}")
    moe[layer].router.logit_offset_E[0] += COLLAPSE_LOGIT_OFFSET


def crash() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def hang() -> None:
    """A wedged process: alive, holding its sockets, no thread of it running (SIGSTOP), so its
    exporter's own beats stop too (a rank stuck in its own Python code while its threads run
    beats on: that is hang@S:ARG's RunStuck, not this HeartbeatLost)."""
    while True:
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(3600)  # if someone sends SIGCONT: still making no progress
