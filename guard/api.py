"""The library API: guard any PyTorch training loop in a few lines.

    from guard.api import GuardedStep
    from guard.integrations.transformers import attach

    guarded = GuardedStep(model, optimizer, attach=attach(model), run_dir="runs/my-run", max_lr=3e-4)
    for batch in guarded.batches(loader):            # drops the data window after a rollback
        loss = model(**batch).loss
        loss.backward()
        decision = guarded.step(loss, tokens=batch["input_ids"].numel())  # steps the optimizer, or not
        if decision.halt:
            break
    guarded.close()

`step()` reads gradients and router statistics (one host copy), runs the detectors and the
policy, then calls `optimizer.step()` only when the update is safe; on a skip neither weights nor
optimizer state change (NaN included); on a rollback it restores the last snapshot before the
incident and skips the next `skip_batches` batches (through `batches()`, or, when the loop does
not use it, by skipping those updates); a collapse correction goes through the attachment's
corrector (a selection-bias push or a per-layer balancing gradient) and is reported only when
the model offers one. Operator commands (skip, rollback, halt) from `commands=` (an exporter
talking to the collector, or a CommandFile an operator writes) are merged into the step's
decision by the same engine the trainer runs.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn

from guard.canary.reference import ReferenceLog
from guard.canary.slow import StepBurner
from guard.core import actions, schema
from guard.core.config import GuardConfig, load_guard_config
from guard.core.events import Event
from guard.core.goodput import Goodput
from guard.core.heartbeat import PHASE_DATA, PHASE_TRAIN
from guard.core.inject import Injection
from guard.core.policy import Decision
from guard.core.report import StepReport
from guard.core.tags import clean_tags
from guard.integrations.base import MODE_NONE, Attachment
from guard.runtime.apply import DecisionApplier
from guard.runtime.commands import CommandSource
from guard.runtime.guard import Guard
from guard.runtime.inject import Injector, resolve
from guard.runtime.probe import Probe
from guard.runtime.ranks import Comm, HeartbeatPump, StepSync, dist_of_process_group
from guard.runtime.service import collector_url
from guard.runtime.session import RunSession, ending

T = TypeVar("T")

# Straggler windows on several ranks: the trainer's telemetry defaults.
STRAGGLER_EVERY, STRAGGLER_THRESHOLD = 20, 0.75


def _default_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks (transformer.h, model.layers, blocks...): the nn.ModuleList holding
    the most parameters, i.e. the outermost stack, not an experts list nested inside one block."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList | nn.ModuleDict) and len(m) > 0]
    if not lists:
        return [model]
    best = max(lists, key=lambda ml: sum(p.numel() for p in ml.parameters()))
    return list(best.values()) if isinstance(best, nn.ModuleDict) else list(best)


class GuardedStep:
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        run_dir: str | Path | None = None,
        config: GuardConfig | str | Path | None = None,
        attach: Attachment | None = None,
        layers: list[nn.Module] | None = None,
        routers: list[tuple[int, Any]] | None = None,
        max_lr: float | None = None,
        grad_clip: float = 0.0,
        dead_window: int = 50,
        commands: CommandSource | None = None,
        collector: str | None = None,
        flops_per_token: float | None = None,
        inject: str | Iterable[str | Injection] | None = None,
        started_at: float | None = None,
        autocast: torch.dtype | None = None,
        tags: Iterable[str] | None = None,
    ) -> None:
        """`attach`: what guard.integrations.<framework>.attach(model) found (layers, routers and
        the collapse corrector); `layers`/`routers` are the manual form of the same for a custom
        model (routers observed, no correction applied). `commands`: where operator commands come
        from (guard.runtime.commands.CommandFile); with a collector they come from it as well.

        `collector`: the collector URL to stream to (default $MOEGUARD_COLLECTOR; bearer token
        from $MOEGUARD_TOKEN), through the trainer's own exporter: rank 0's full reports, every
        rank's own timing and heartbeats with its phase; OTLP too when $OTEL_EXPORTER_OTLP_ENDPOINT
        is set. Needs `run_dir` (its name is the run id; its spool/ holds what the collector has
        not acknowledged yet). `flops_per_token`: training FLOPs per token (torchtitan: its
        `get_nparams_and_flops`; transformers: guard.integrations.hf_flops.flops_per_token)
        for MFU against the same peaks as `moeguard train` (guard/runtime/peak.py).

        `inject`: drills, the same KIND@STEP[:ARG][/rRANK] specs and fault kinds as `moeguard
        train --inject` (a list, or one comma-separated string; guard/core/inject.py); default
        $MOEGUARD_INJECT. guard/runtime/inject.py says where each fault is applied.

        `started_at`: when the loop's work began (time.time(); default: now). Step 0's time and
        the run's wall time start there: a loop that builds its GuardedStep late (MoEGuardCallback,
        at the first optimizer step) passes its train start, so step 0 is timed over the whole
        step like every other (from the previous step's end, or this start, to the decision).
        `autocast`: the dtype the forward runs in under torch.autocast (meta.json env "dtype");
        default: read from the model's forwards before the first step (a forward under
        `with torch.autocast(...)` says so), else the parameters' dtype.
        `tags`: meta.json "tags", what the Runs page filters by (guard/core/tags.py).

        Under torchrun every rank builds a GuardedStep: the probe's one all-reduce gives every
        rank the same statistics, one MAX all-reduce checks that every rank decided the same
        (else the run halts before anything is applied), and rank 0 writes the run store."""
        if isinstance(config, str | Path):
            config = load_guard_config(config)
        self.cfg = config or GuardConfig()
        self.model = model
        self.optimizer = optimizer
        self.commands = commands
        if attach is not None:
            layers, routers = attach.layers, attach.routers
        device = next(model.parameters()).device
        self.ranks = dist_of_process_group()
        self.comm = Comm(self.ranks.world)
        self.probe = Probe(
            model,
            dead_window=dead_window,
            device=device,
            layers=layers if layers is not None else _default_layers(model),
            routers=routers or [],
            optimizer=optimizer,
            precursor=self.cfg.precursor,
            all_reduce=self.comm.all_reduce,
        )
        self.layer_ids = np.arange(self.probe.n_layers, dtype=np.int32)
        mode = attach.correction_mode if attach is not None else MODE_NONE
        self.corrector = attach.corrector if attach is not None else None
        self.guard = Guard(self.cfg, model, optimizer, max_lr=max_lr, correction=mode)
        self.applier = DecisionApplier(
            optimizer,
            self.guard,
            grad_clip=grad_clip,
            corrector=self.corrector,
            after_step=attach.after_step if attach is not None else None,
        )
        self.session = _open_session(
            run_dir,
            collector,
            model,
            device,
            self.ranks,
            flops_per_token,
            attach,
            mode,
            self.cfg,
            started_at=started_at,
            autocast=autocast,
            tags=clean_tags(tags),
            grad_clip=grad_clip,
        )
        # until the first step: a forward under torch.autocast tells the dtype the step computes in
        self._autocast_hook = (
            model.register_forward_pre_hook(self._note_autocast) if autocast is None else None
        )
        self.store = self.session.store
        self.sync = (
            StepSync(
                self.ranks,
                self.comm,
                device,
                straggler_every=STRAGGLER_EVERY,
                straggler_threshold=STRAGGLER_THRESHOLD,
                exporter=_Polled(commands, self.session.exporter),
                commands=self.guard.commands,
            )
            if self.ranks.world > 1
            else None
        )
        # marks this rank's beats `waiting` while it sits in the guard's own collectives (the
        # framework's, inside forward and backward, are not seen: docs/NOTES.md)
        exporter = self.session.exporter
        self.pump = (
            HeartbeatPump(self.comm, exporter) if exporter is not None and self.ranks.world > 1 else None
        )
        self.step_idx = 0
        # the step clock: a step's time runs from the previous step's decision (or the start)
        # to its own, so every step, step 0 included, holds its data wait, forward and backward
        self._t_last = time.perf_counter() - max(0.0, time.time() - self.session.started_at)
        self.counts: dict[str, int] = {}
        self.guard_actions = actions.zero()
        self.goodput = Goodput(started_at=self.session.meta["started_at"])
        self.pending_skip = 0  # batches still to drop after a rollback (the PaLM data window)
        self._data_wait = 0.0  # this rank's seconds in the loader since the last step
        # `moeguard canary --ab ... --inject slow:PCT` on this run: PCT% of each step burnt in step()
        self._burn = StepBurner.from_env(sync=torch.cuda.synchronize if device.type == "cuda" else None)
        # `moeguard canary --ab --script/--torchtitan` on a CPU: the machine's yardstick after each
        # step (guard/canary/reference.py), outside the step's clock, so a neighbour divides out
        self._yardstick = ReferenceLog.from_env(
            self.session.run_dir, rank=self.ranks.rank, on_cpu=device.type == "cpu"
        )
        self.last_decision: Decision | None = None
        drills = resolve(inject)
        self.injector = (
            Injector(drills, self, collapse=getattr(attach, "force_collapse", None)) if drills else None
        )

    # ---- data window ------------------------------------------------------------------------
    def batches(self, loader: Iterable[T]) -> Iterator[T]:
        """Yield the loader's batches, dropping the data window a rollback asks to skip. The time
        spent waiting for each batch is the step's data wait (the `data` phase in heartbeats)."""
        it = iter(loader)
        while True:
            self.session.phase(PHASE_DATA)
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                self.session.phase(PHASE_TRAIN)
                return
            self._data_wait += time.perf_counter() - t0
            self.session.phase(PHASE_TRAIN)
            if self.pending_skip > 0:
                self.pending_skip -= 1
                continue
            yield batch

    def restart_clock(self) -> None:
        """The time until now is not the next step's (a checkpoint save, an eval in between)."""
        self._t_last = time.perf_counter()

    def _note_autocast(self, module: nn.Module, args: Any) -> None:
        device_type = self.probe.device.type
        if torch.is_autocast_enabled(device_type):
            self.session.computes_in(torch.get_autocast_dtype(device_type))
            self._stop_autocast_watch()

    def _stop_autocast_watch(self) -> None:
        if self._autocast_hook is not None:
            self._autocast_hook.remove()
            self._autocast_hook = None

    def note_data_wait(self, seconds: float) -> None:
        """A loop that does not use batches() adds its own data wait for the current step here."""
        self._data_wait += seconds

    # ---- the step ---------------------------------------------------------------------------
    def step(self, loss: torch.Tensor, *, tokens: int = 0, n_micro: int = 1) -> Decision:
        """Call after backward with this rank's mean loss and the tokens THIS rank processed this
        step (summed over ranks here). Steps the optimizer only if the guard allows it."""
        world, rank = self.ranks.world, self.ranks.rank
        self._stop_autocast_watch()
        drilled = self.injector.before_step(self.step_idx) if self.injector is not None else []
        own_wait, self._data_wait = self._data_wait, 0.0
        extra = None
        if world > 1:  # each rank's data wait (one-hot) and token count ride in the probe's all-reduce
            extra = torch.zeros(world + 1, device=loss.device)
            extra[rank], extra[world] = own_wait, float(tokens)
        pr = self.probe.collect(loss.detach() * n_micro, n_micro, extra=extra)
        job_wait = float(pr.extra[:world].max()) if world > 1 else own_wait
        job_tokens = int(round(pr.extra[world])) if world > 1 else tokens
        planned = [float(g["lr"]) for g in self.optimizer.param_groups]
        rep = StepReport(
            step=self.step_idx,
            time=time.time(),
            loss=pr.loss,
            grad_norm=pr.grad_norm,
            lr=planned[0],
            tokens=job_tokens,
            data_wait_s=job_wait,
            rank=rank,
            layer_ids_L=self.layer_ids,
            layer_grad_norm_L=pr.layer_grad_norm_L,
            moe_layer_ids_M=self.probe.moe_ids_M,
            router_entropy_M=pr.router_entropy_M,
            load_entropy_M=pr.load_entropy_M,
            maxvio_M=pr.maxvio_M,
            dead_experts_M=pr.dead_experts_M,
            bias_norm_M=pr.bias_norm_M,
            load_ME=pr.load_ME,
            bias_ME=pr.bias_ME,
            **pr.precursors,
        )
        d, events = self._decide(rep, planned[0])
        events[:0] = drilled
        if d.applies_update and self.pending_skip > 0:
            # A rollback asked to skip a data window and this loop does not drop batches through
            # batches(): skip the update of each batch of the window instead.
            self.pending_skip -= 1
            d.action = schema.ACT_SKIP
            ev = Event(
                step=self.step_idx,
                kind=schema.EV_ACTION,
                action=schema.ACT_SKIP,
                detail={"reason": "data window after a rollback", "left": self.pending_skip},
            )
            d.events.append(ev)
            events.append(ev)
        rep.lr = planned[0] * d.lr_scale if d.applies_update else planned[0]
        done = self.applier.apply(d, grad_norm=pr.grad_norm, loads_ME=self.probe.loads_ME)
        if self.injector is not None:
            self.injector.after_step()
        if done.restored_step is not None:
            self.pending_skip = d.skip_batches
            self.goodput.rolled_back(done.restored_step)
        self.probe.reset_router_stats()
        # The yardstick right after the update, before any injected burn: it times differently after
        # different code (measured: 2.0 ms back to back, ~4 ms after 0.1 s of torch work or of the
        # burn's busy loop), so A and B must reach it through the same code, as in the canary worker.
        # Its time is neither the step's nor part of what a slowdown scales.
        yard_s = yard_cpu_s = 0.0
        if self._yardstick is not None:
            y0 = time.perf_counter()
            yard_cpu_s = self._yardstick.time_step(self.step_idx)
            yard_s = time.perf_counter() - y0
        if self._burn is not None:
            self._burn(skip=yard_cpu_s)
        now = time.perf_counter()
        rep.step_time_s, self._t_last = now - self._t_last - yard_s, now
        rep.tokens_per_s = job_tokens / rep.step_time_s if job_tokens else float("nan")
        rep.mfu = self.session.mfu(rep.tokens_per_s) if job_tokens else float("nan")
        rep.mem_peak_bytes = _peak_memory_bytes(self.probe.device)
        rep.action = d.action
        self.counts[d.action] = self.counts.get(d.action, 0) + 1
        actions.tally(self.guard_actions, d.action, events)
        self.goodput.step(d.applies_update, rep.step_time_s, job_wait)
        if self.sync is not None:
            busy = rep.step_time_s - own_wait - self.comm.take_wait()
            events.extend(self.sync.end_step(self.step_idx, busy, own_wait, tokens, self.store))
            rep.straggler_score = self.sync.straggler_score
        self.session.step(rep, events, self.sync.take_vectors() if self.sync is not None else None)
        self.step_idx += 1
        self.last_decision = d
        if self.guard.after_step(self.step_idx):
            self.goodput.snapshot_taken(
                self.step_idx, set(self.guard.ring.steps()) if self.guard.ring else set()
            )
        return d

    def log(self, step: int | None = None, **metrics: float) -> None:
        """Record evaluation metrics, e.g. `guarded.log(eval_loss=2.31)`, in the run store's `evals`
        table (rank 0; other ranks' calls are ignored, as their metrics are the same after the loop's
        all-reduce). `step`: the last step taken before they were measured (default: the last step()'s,
        0-based; the Trainer's global_step - 1), where the app draws them over the train loss.
        Values: numbers, or one-element tensors (read on the host)."""
        vals: dict[str, float] = {}
        for name, v in metrics.items():
            if isinstance(v, torch.Tensor):
                v = v.detach().float().item()
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise TypeError(f"GuardedStep.log({name}={v!r}): a metric must be a number")
            vals[name] = float(v)
        self.session.record.evals(self.step_idx - 1 if step is None else int(step), time.time(), vals)

    def _decide(self, rep: StepReport, lr: float) -> tuple[Decision, list[Event]]:
        """The engine's decision, with the operator's command; on several ranks, agreed by all."""
        if self.sync is None:  # one rank: a command polled now applies now
            if self.commands is not None:
                self.guard.commands.offer(self.commands.poll_commands())
            if self.session.exporter is not None:
                self.guard.commands.offer(self.session.exporter.poll_commands())
            d = self.guard.observe(rep, lr=lr, command=self.guard.commands.next())
            return d, list(d.events)
        # several ranks: the command agreed at the previous step applies now, on every rank
        d = self.guard.observe(rep, lr=lr, command=self.sync.take_pending())
        events = list(d.events)
        return self.sync.agree(self.step_idx, d, events), events

    # ---- state: a framework's checkpoint holds it (torchtitan's Stateful protocol) -----------
    def state_dict(self) -> dict[str, Any]:
        s = {
            "step": self.step_idx,
            "guard": self.guard.state_dict(),
            "probe": self.probe.state_dict(),
            "pending_skip": self.pending_skip,
            "counts": dict(self.counts),
            "guard_actions": dict(self.guard_actions),
            "goodput": self.goodput.state_dict(),
            "saved_at": time.time(),  # a resume books the time from here to its start as restarts_s
        }
        if self.sync is not None:
            s["sync"] = self.sync.state_dict()
        if hasattr(self.corrector, "state_dict"):  # the standing bias update's momentum (SMEBU)
            s["corrector"] = self.corrector.state_dict()
        return s

    def load_state_dict(self, s: dict[str, Any], *, checkpoint: str = "") -> None:
        """Restore what state_dict() returned (a framework's resume); `checkpoint` names it in the
        run's resume event."""
        self.step_idx = int(s["step"])
        self.guard.load_state_dict(s["guard"])
        self.probe.load_state_dict(s["probe"])
        self.pending_skip = int(s.get("pending_skip", 0))
        self.counts = dict(s.get("counts", {}))
        self.guard_actions = {**actions.zero(), **s.get("guard_actions", {})}
        if "goodput" in s:
            self.goodput.load_state_dict(s["goodput"])
            if "saved_at" in s:  # progress after the checkpoint, and the time the job was down
                self.goodput.resumed(float(s["saved_at"]), self.session.started_at)
        if self.sync is not None and "sync" in s:
            self.sync.load_state_dict(s["sync"])
        if "corrector" in s and hasattr(self.corrector, "load_state_dict"):
            self.corrector.load_state_dict(s["corrector"])
        self.session.resumed(self.step_idx, checkpoint, world_size=self.ranks.world)

    # ---- the end ----------------------------------------------------------------------------
    def close(self, status: str | None = None, note: str = "") -> None:
        """Record how the run ended (default: from how the process is leaving: finished, or
        crashed / interrupted / preempted when called while such an exception propagates), send
        the last batch, and print the end-of-run summary on rank 0 (as `moeguard train`)."""
        if self.session.closed:
            return
        exc = sys.exc_info()[1]
        if status is None:
            status, note = ending(exc)
            if (
                status == schema.STATUS_FINISHED
                and self.last_decision is not None
                and self.last_decision.halt
            ):
                why = next(
                    (
                        str(e.detail.get("reason", ""))
                        for e in self.last_decision.events
                        if e.kind == schema.EV_HALT
                    ),
                    "an operator command",
                )
                status, note = schema.STATUS_HALTED, f"halted at step {self.step_idx - 1}: {why}"
        self.probe.close()
        self._stop_autocast_watch()
        if self.injector is not None:
            self.injector.remove()
        if self.pump is not None:
            self.pump.close()
        if self.sync is not None:
            self.sync.log.close()
        if self._yardstick is not None:
            self._yardstick.close()
        gp = self.goodput.report(time.time())
        self.session.finish(
            status,
            note,
            final_step=self.step_idx,
            counts=self.counts,
            guard_actions=self.guard_actions,
            goodput=gp,
        )
        for line in self.session.summary(
            steps=self.step_idx, counts=self.counts, guard_actions=self.guard_actions, goodput=gp["goodput"]
        ):
            print(line, file=sys.stderr)

    def __enter__(self) -> GuardedStep:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open_session(
    run_dir: str | Path | None,
    collector: str | None,
    model: nn.Module,
    device: torch.device,
    ranks: Any,
    flops_per_token: float | None,
    attach: Attachment | None,
    mode: str,
    cfg: GuardConfig,
    *,
    started_at: float | None,
    autocast: torch.dtype | None,
    tags: list[str],
    grad_clip: float,
) -> RunSession:
    """The run around the step: store (rank 0), exporter, meta.json, how the run ends."""
    run_dir = Path(run_dir) if run_dir is not None else None
    if collector_url(collector) and run_dir is None:
        raise ValueError(
            f"GuardedStep(collector={collector_url(collector)!r}) needs run_dir= as well: its name is "
            "the run id and its spool/ keeps what the collector has not acknowledged yet"
        )
    return RunSession(
        run_dir,
        collector=collector,
        rank=ranks.rank,
        world=ranks.world,
        model=model,
        device=device,
        flops_per_token=flops_per_token,
        started_at=started_at,
        autocast=autocast,
        meta={
            "integration": {"family": attach.family if attach else type(model).__name__, "correction": mode},
            # the grad clip, so `moeguard replay` resolves a spike as the run did (guard/replay.py)
            "config": {"guard": _asdict(cfg), "optim": {"grad_clip": grad_clip}},
            "world_size": ranks.world,
            schema.META_TAGS: tags,
        },
    )


class _Polled:
    """The operator-command sources StepSync polls on rank 0: a CommandFile and/or the collector."""

    def __init__(self, *sources: CommandSource | Any) -> None:
        self.sources = [s for s in sources if s is not None]

    def poll_commands(self) -> list[dict[str, Any]]:
        return [c for s in self.sources for c in s.poll_commands()]


def _peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # Linux reports KiB


def _asdict(cfg: GuardConfig) -> dict[str, Any]:
    from guard.core.tomlconf import to_dict

    return to_dict(cfg)
