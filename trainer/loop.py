"""The guarded training loop.

One step (`train_step`, top to bottom):
    data (timed) -> forward/backward over micro-batches -> [gradient all-reduce (ddp)]
    -> Probe.collect: every statistic reduced across ranks in one all-reduce, one device->host copy
    -> Guard.observe: the engine (detectors + policy + the pending operator command) -> Decision
    -> [ranks agree: one tiny MAX all-reduce of the decision's fingerprint and the next command]
    -> [guard.rerun, off by default: a flagged step is recomputed once from the same state;
        a clean recompute is a suspected hardware fault and is applied instead (trainer/rerun.py)]
    -> DecisionApplier (guard/runtime/apply.py): clip, LR, optimizer.step, expert-bias update
       (trainer/correction.py) | skip | roll back | halt
    -> run store (rank 0) / exporter (every rank; background threads; never block the step)
    -> every telemetry.straggler_every steps: ONE all_gather of each rank's timing summary

Whatever else happens in a step is a callback, called at fixed hooks (trainer/callbacks/: fault
injection for drills, the profiler, the canary's timing); the loop knows nothing of what they do.
Multi-rank details (parallel modes, why every rank decides the same, heartbeats) are in
trainer/distributed.py; checkpoint save/resume over a TrainState in trainer/checkpoint.py; where
rows and meta.json go in trainer/record.py; how a run ends (statuses, exit codes) in
trainer/outcome.py; goodput in guard/core/goodput.py.
"""

from __future__ import annotations

import math
import resource
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from guard.core import actions, schema
from guard.core.goodput import Goodput
from guard.core.policy import Decision
from guard.core.report import StepReport
from guard.core.tomlconf import ConfigError, to_dict
from guard.runtime.apply import DecisionApplier
from guard.runtime.guard import Guard
from guard.runtime.probe import Probe, ProbeResult
from guard.store.runstore import RunStore
from trainer import checkpoint as ckpt
from trainer import outcome
from trainer.callbacks.callback import Callback, Callbacks
from trainer.callbacks.fault_injection import FaultInjection
from trainer.callbacks.profiler import Profiler
from trainer.config import TrainConfig
from trainer.console import Console, action_lines
from trainer.correction import ModelCorrector
from trainer.data import DataLoader
from trainer.distributed import (
    Comm,
    HeartbeatPump,
    StepSync,
    restart_count,
    setup_distributed,
)
from trainer.flops import flops_per_token, peak_flops
from trainer.inject import Injection
from trainer.model import MoETransformer
from trainer.record import RunRecord, run_environment, run_meta
from trainer.rerun import RerunCheck
from trainer.resume_check import restore_checked
from trainer.step_gc import StepGC
from trainer.train_module import TrainModule, set_deterministic


def lr_at(opt_step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to lr * min_lr_ratio at the last step."""
    o = cfg.optim
    if opt_step < o.warmup_steps:
        return o.lr * (opt_step + 1) / o.warmup_steps
    span = max(1, cfg.train.steps - o.warmup_steps)
    frac = min(1.0, (opt_step - o.warmup_steps) / span)
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # Linux reports KiB


def step_report(step: int, pr: ProbeResult, probe: Probe, layer_ids: np.ndarray, **fields: Any) -> StepReport:
    """The guard's view of one step: the probe's reduced statistics plus the loop's `fields`."""
    return StepReport(
        step=step,
        time=time.time(),
        loss=pr.loss,
        grad_norm=pr.grad_norm,
        layer_ids_L=layer_ids,
        layer_grad_norm_L=pr.layer_grad_norm_L,
        moe_layer_ids_M=probe.moe_ids_M,
        router_entropy_M=pr.router_entropy_M,
        load_entropy_M=pr.load_entropy_M,
        maxvio_M=pr.maxvio_M,
        dead_experts_M=pr.dead_experts_M,
        bias_norm_M=pr.bias_norm_M,
        load_ME=pr.load_ME,
        bias_ME=pr.bias_ME,
        **pr.precursors,
        **fields,
    )


def build_applier(
    cfg: TrainConfig, model: MoETransformer, opt: torch.optim.Optimizer, guard: Guard, routers: list[Any]
) -> DecisionApplier:
    """How a decision reaches this model: clip and step, and collapse corrections through the
    routers' selection bias (bias_mode sign/smebu) or the aux-loss weight (trainer/correction.py)."""
    corrector = ModelCorrector(
        model,
        routers,
        bias=cfg.model.bias_mode != "off",
        bias_max=cfg.guard.policy.bias_max,
        aux_coef=cfg.model.aux_loss_coef,
    )
    return DecisionApplier(opt, guard, grad_clip=cfg.optim.grad_clip, corrector=corrector)


def builtin_callbacks(
    cfg: TrainConfig, run_dir: Path, device: torch.device, *, rank: int, injections: list[Injection]
) -> list[Callback]:
    """Fault injection (every rank; the plain loop takes only the data faults) and, when
    telemetry.profile is on, the profiler (rank 0 of a guarded run)."""
    t = cfg.telemetry
    out: list[Callback] = [
        FaultInjection(injections, rank=rank, attempt=restart_count(), data_faults_only=not t.enabled)
    ]
    if t.profile and rank == 0 and t.enabled:
        trace_dir = run_dir / schema.PROFILE_DIR
        out.append(
            Profiler(trace_dir, device, wait=t.profile_wait, warmup=t.profile_warmup, active=t.profile_active)
        )
    return out


class Trainer:
    def __init__(
        self,
        cfg: TrainConfig,
        run_dir: str | Path,
        *,
        resume: bool = False,
        injections: list[Injection] | None = None,
        progress: bool = True,
        exporter: Any = None,
        callbacks: list[Callback] | None = None,
    ) -> None:
        """`callbacks` run before the built-in ones (fault injection, profiler) at every hook."""
        self._t_start = time.time()
        self.cfg, self.run_dir, self.exporter = cfg, Path(run_dir), exporter
        self.dist, self.device = setup_distributed(cfg.train.device)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        if cfg.train.deterministic and self.device.type == "cpu":
            set_deterministic(cfg.train.compile)
        torch.manual_seed(cfg.train.seed)
        self.comm = Comm(self.dist.world)
        self.module = TrainModule(cfg, self.dist, self.device, self.comm)
        self.model, self.opt, self.params = self.module.model, self.module.opt, self.module.params
        self.dtype, self.parallel = self.module.dtype, self.module.parallel
        d = self.dist
        self.data = DataLoader(
            cfg.data, vocab_size=cfg.model.vocab_size, seed=cfg.train.seed, rank=d.rank, world_size=d.world
        )
        self.telemetry = cfg.telemetry.enabled
        self._build_guard()
        self.state = ckpt.TrainState()
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)
        self.peak, self.peak_source = peak_flops(self.device, self.dtype)
        self.env = {**run_environment(self), "parallel": self.parallel}
        self.gp = Goodput(started_at=self._t_start)
        self.final_goodput: dict[str, float] | None = None  # taken once, when the run ends
        self.last_decision: Decision | None = None
        self.last_checkpoint: Path | None = None
        self.preemption = outcome.Preemption()
        self.step_gc = StepGC(cfg.train.gc_every)
        self.progress = progress and d.main
        self.console = Console(self.run_dir.name, cfg.train.steps)
        self.store = (
            RunStore(self.run_dir, flush_every=cfg.telemetry.flush_every, policy=cfg.store)
            if d.main
            else None
        )
        self.record = RunRecord(self.run_dir, self.store, exporter, rank=d.rank)
        builtin = builtin_callbacks(cfg, self.run_dir, self.device, rank=d.rank, injections=injections or [])
        self.callbacks = Callbacks(self, [*(callbacks or []), *builtin])
        # everything with its own state in host.pt, by key (the model and optimizer go to DCP)
        parts = {"data": self.data, "guard": self.guard, "probe": self.probe, "sync": self.sync}
        self.checkpoints = ckpt.Checkpointer(
            self.run_dir / schema.CHECKPOINT_DIR,
            self.model,
            self.opt,
            self.state,
            {**parts, "goodput": self.gp, "callbacks": self.callbacks},
            dist=d,
            keep=cfg.train.keep_checkpoints,
            barrier=self.comm.barrier if d.world > 1 else lambda: None,
        )
        if resume:
            self._resume()
        else:
            self.record.started(run_meta(self, schema.STATUS_RUNNING), restarted=restart_count() > 0)
        if exporter is not None:
            self.record.announce(lambda: run_meta(self, schema.STATUS_RUNNING))

    def _build_guard(self) -> None:
        """The probe, the guard and how its decisions are applied; the multi-rank agreement."""
        cfg, t = self.cfg, self.cfg.telemetry
        self.probe = Probe(
            self.model,
            dead_window=t.dead_window,
            device=self.device,
            all_reduce=self.comm.all_reduce,
            optimizer=self.opt,
            precursor=cfg.guard.precursor,
        )
        self.probe_layer_ids = np.arange(len(self.model.blocks), dtype=np.int32)
        has_bias = cfg.model.bias_mode != "off"
        self.guard = Guard(cfg.guard, self.model, self.opt, max_lr=cfg.optim.lr, has_bias=has_bias)
        self.applier = build_applier(cfg, self.model, self.opt, self.guard, self.probe.routers)
        # multi-rank: decision agreement, operator commands, straggler windows, heartbeats
        self.sync = StepSync(
            self.dist,
            self.comm,
            self.device,
            straggler_every=t.straggler_every,
            straggler_threshold=t.straggler_threshold,
            exporter=self.exporter,
            commands=self.guard.commands,
        )
        self.rerun = RerunCheck(cfg.guard.rerun, self.guard, self.probe, self.module, rank=self.dist.rank)
        # one rank too: `--inject hang@S:SECONDS` blocks inside comm.timed() like a hung collective
        # rank 0 beats with its reports and sends no idle beats: the pump beats for it while it
        # waits; other ranks beat at the job's bounded rate on their own and only get the flag
        self.pump = (
            HeartbeatPump(self.comm, self.exporter, beat_s=0.5 if self.dist.rank == 0 else None)
            if self.exporter is not None
            else None
        )

    # ---- the TrainState, read through -------------------------------------------------------
    @property
    def step(self) -> int:
        """Iterations run (monotonic; the run store's key)."""
        return self.state.step

    @step.setter
    def step(self, value: int) -> None:
        self.state.step = value

    @property
    def opt_step(self) -> int:
        """Updates actually applied (drives the LR schedule; restored on rollback)."""
        return self.state.opt_step

    @opt_step.setter
    def opt_step(self, value: int) -> None:
        self.state.opt_step = value

    # ---- checkpoints ------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        t0 = time.perf_counter()
        self.record.checkpoint_starts()
        path = self.checkpoints.save(
            config=to_dict(self.cfg), world_size=self.dist.world, parallel=self.parallel
        )
        self.gp.add("checkpoint_s", time.perf_counter() - t0)
        self.last_checkpoint = path
        self.record.checkpoint_saved(self.step, path, self.goodput)
        return path

    def _resume(self) -> None:
        path = self.checkpoints.latest()
        if path is None:
            raise ConfigError(f"--resume: no checkpoint in {self.checkpoints.dir}")
        self.last_checkpoint = path
        r = restore_checked(self.checkpoints, path, self.run_dir, check_store=self.dist.main)
        if r.legacy:  # one torch.save file from before DCP kept only the time split
            self.gp.split.update(r.host.get("time_split", {}))
        else:
            self.gp.resumed(float(r.host.get("saved_at", self._t_start)), self._t_start)
        self.record.resumed(
            self.step,
            path,
            self.env,
            lambda: run_meta(self, schema.STATUS_RUNNING),
            world_size=self.dist.world,
            saved_world_size=r.host.get("world_size", 1),
        )

    # ---- one step ---------------------------------------------------------------------------
    def train_step(self) -> StepReport:
        """One step: the guarded one, or with telemetry off the plain loop any PyTorch user writes."""
        t0 = time.perf_counter()
        self.comm.take_wait()  # time inside collectives from here on is this step's
        self.callbacks.pre_step(self.step)
        rep = self._guarded_step(t0) if self.telemetry else self._plain_step(t0)
        self.callbacks.post_step(self.step, rep)
        return rep

    def _guarded_step(self, t0: float) -> StepReport:
        batches, data_wait = self._batches()
        self.rerun.remember()
        loss_sum = self._forward_backward(batches)
        planned_lr = self.callbacks.adjust_lr(self.step, lr_at(self.opt_step, self.cfg))
        world, rank = self.dist.world, self.dist.rank
        # each rank's data wait rides in the probe's all-reduce as a one-hot; the guard sees the
        # slowest rank's (the step waited for it), so its stall verdict is the same on every rank
        # (the last element: 1 on a rank that got SIGTERM, so all ranks stop at the same step)
        onehot = torch.zeros(world + 1, device=self.device) if world > 1 else None
        if onehot is not None:
            onehot[rank] = data_wait
            onehot[world] = float(self.preemption.requested)
        pr = self.probe.collect(loss_sum, len(batches), extra=onehot)
        job_wait = float(pr.extra[:world].max()) if world > 1 else data_wait
        self.preemption.agreed = bool(pr.extra[world] > 0) if world > 1 else self.preemption.requested
        own_tokens = sum(b.numel() - b.size(0) for b in batches)
        fields = {"lr": planned_lr, "tokens": own_tokens * world, "data_wait_s": job_wait, "rank": rank}
        rep = self._report(pr, t0, fields)
        # the operator command agreed at the previous step is merged into this step's decision
        command = self.sync.take_pending()
        decision = self.guard.observe(rep, lr=planned_lr, command=command)
        events = list(decision.events)
        decision = self.sync.agree(self.step, decision, events)
        if self.rerun.wanted(decision):  # guard.rerun: recompute once; transient or reproducible?
            redo = self.rerun.check(
                decision,
                events,
                (pr, rep),
                lambda: self.probe.collect(self._forward_backward(batches), len(batches), extra=onehot),
                lambda p: self._report(p, t0, fields),
                lambda r: self.guard.observe(r, lr=planned_lr, command=command),
            )
            decision, events, pr, rep = redo.decision, redo.events, redo.probe, redo.report
            if self.dist.main:
                self.console.say(redo.line)
        rep.lr = planned_lr * decision.lr_scale
        self.callbacks.pre_record(self.step, events)
        done = self.applier.apply(
            decision, grad_norm=pr.grad_norm, loads_ME=self.probe.loads_ME, lr=planned_lr
        )
        if done.updated:
            self.opt_step += 1
        elif done.restored_step is not None:
            self.opt_step = done.restored_extra["opt_step"]
            self.data.skip(decision.skip_batches)
            self.gp.rolled_back(done.restored_step)
        self.probe.reset_router_stats()
        rep.action = decision.action
        rep.step_time_s = time.perf_counter() - t0
        rep.tokens_per_s = rep.tokens / rep.step_time_s
        rep.mfu = self.flops_per_token * rep.tokens_per_s / (self.peak * world) if self.peak else float("nan")
        rep.mem_peak_bytes = peak_memory_bytes(self.device)
        self.state.counts[decision.action] = self.state.counts.get(decision.action, 0) + 1
        actions.tally(self.state.guard_actions, decision.action, events)
        finite = self._track_finite(rep.loss, rep.grad_norm, applied=decision.applies_update)
        self.gp.step(decision.applies_update, rep.step_time_s, rep.data_wait_s, finite=finite)
        if self.dist.main:
            for line in action_lines(self.step, decision.action, events):
                self.console.say(line)
        # busy = the step minus the time spent inside collectives (waiting for peers included)
        busy = rep.step_time_s - self.comm.take_wait()
        events.extend(self.sync.end_step(self.step, busy, data_wait, own_tokens, self.store))
        rep.straggler_score = self.sync.straggler_score
        self.record.step(rep, events, self.sync.take_vectors())
        self.last_decision = decision
        return rep

    def _report(self, pr: ProbeResult, t0: float, fields: dict[str, Any]) -> StepReport:
        rep = step_report(self.step, pr, self.probe, self.probe_layer_ids, **fields)
        if self.dist.world == 1:
            # Provisional throughput (time so far) so the throughput detector sees this step; with
            # several ranks each would see its own clock, so there the collector watches throughput.
            elapsed = time.perf_counter() - t0
            rep.step_time_s, rep.tokens_per_s = elapsed, rep.tokens / elapsed
        return rep

    def _forward_backward(self, batches: list[torch.Tensor]) -> torch.Tensor:
        """Forward/backward, the post_backward hook, then the gradient reduction across ranks."""
        loss_sum = self.module.forward_backward(batches)
        self.callbacks.post_backward(self.step)  # this rank's gradients, before the reduction spreads them
        self.rerun.note_local(loss_sum)  # what names a rank whose pass diverged
        self.module.reduce_grads()
        return loss_sum

    def _plain_step(self, t0: float) -> StepReport:
        """Telemetry off: the loop any PyTorch user writes (the overhead benchmark's baseline)."""
        batches, data_wait = self._batches()
        loss_sum = self.module.forward_backward(batches)
        self.callbacks.post_backward(self.step)
        self.module.reduce_grads()
        lr = lr_at(self.opt_step, self.cfg)
        self.module.plain_update(lr, self.probe)
        self.opt_step += 1
        self.probe.reset_router_stats()
        loss = loss_sum.item() / len(batches)
        dt = time.perf_counter() - t0
        tokens = sum(b.numel() - b.size(0) for b in batches) * self.dist.world
        self._track_finite(loss, 0.0, applied=True)  # no grad norm measured here: the loss says it
        return StepReport(
            step=self.step,
            time=time.time(),
            loss=loss,
            grad_norm=float("nan"),
            lr=lr,
            tokens=tokens,
            step_time_s=dt,
            data_wait_s=data_wait,
            tokens_per_s=tokens / dt,
        )

    def _batches(self) -> tuple[list[torch.Tensor], float]:
        self.callbacks.pre_load_batch(self.step)
        t0 = time.perf_counter()
        batches = [self.data.next_batch() for _ in range(self.cfg.train.grad_accum)]
        wait = time.perf_counter() - t0
        self.callbacks.post_load_batch(self.step, batches)
        return [b.to(self.device, non_blocking=True) for b in batches], wait

    def _track_finite(self, loss: float, grad_norm: float, *, applied: bool) -> bool:
        """TrainState.track_finite, and a line for the user at the first non-finite update applied."""
        first = applied and self.state.nonfinite_since is None
        finite = self.state.track_finite(loss, grad_norm, applied=applied)
        if not finite and first and self.dist.main:
            self.console.say(
                f"step {self.step}: loss {loss:.4g}, grad norm {grad_norm:.4g}: a non-finite update "
                f"was applied ({'guard in observe mode' if self.telemetry else 'telemetry off'}); "
                "the weights are likely non-finite from here"
            )
        return finite

    # ---- the loop ---------------------------------------------------------------------------
    def run(self, until: int | None = None) -> int:
        """Train to cfg.train.steps (or stop early at `until`, checkpointed, e.g. for a job's time
        slice). Returns the exit code; meta.json["status"] and ["status_note"] say how it ended
        (trainer/outcome.py). An exception is recorded as crashed (Ctrl-C: interrupted) and raised."""
        stop = min(until, self.cfg.train.steps) if until is not None else self.cfg.train.steps
        self.gp.add("startup_s", time.time() - self._t_start)
        if self.progress:
            self.console.progress(self.step)
        self.callbacks.pre_train()
        self.preemption.install(can_agree=self.dist.world == 1 or self.telemetry)
        end = outcome.Ending(schema.STATUS_FINISHED, 0)
        try:
            self.step_gc.start()
            while self.step < stop:
                rep = self.train_step()
                self.step += 1
                if (early := self._stop_early()) is not None:
                    end = early
                    break
                self._between_steps(rep)
            else:
                self.save_checkpoint()
                end = self._ran_to_stop()
        except KeyboardInterrupt:
            end = outcome.interrupted(self.step, self.last_checkpoint)
            raise
        except BaseException as e:
            end = outcome.crashed(self.step, e)
            raise
        finally:
            self.step_gc.restore()
            self.callbacks.close()
            self.console.close()
            try:  # a SIGTERM now only sets the flag: torchrun's, after a peer died, must not cut
                self._finish(end)  # meta.json or the goodbye batch short (issue #37)
            finally:
                self.preemption.uninstall()
        return end.code

    def _stop_early(self) -> outcome.Ending | None:
        """After a step: a halt decision, or a SIGTERM every rank saw, ends the run here, checkpointed."""
        d = self.last_decision
        if d is not None and d.halt:
            self.save_checkpoint()
            why = next(
                (str(e.detail.get("reason", "")) for e in d.events if e.kind == schema.EV_HALT),
                "an operator command",
            )
            return outcome.halted(self.step - 1, why, self.last_checkpoint)
        if self.preemption.agreed if self.dist.world > 1 else self.preemption.requested:
            if self.last_checkpoint != self.checkpoints.path(self.step):
                self.save_checkpoint()
            end = outcome.preempted(self.step - 1, self.last_checkpoint)
            if self.dist.main:
                self.console.say(f"moeguard train: {end.note}")
            return end
        return None

    def _between_steps(self, rep: StepReport) -> None:
        if self.guard.after_step(self.step, {"opt_step": self.opt_step}):
            self.sync.log.write(f"{self.step} snapshot")
            self.gp.snapshot_taken(self.step, set(self.guard.ring.steps()) if self.guard.ring else set())
        every = self.cfg.train.checkpoint_every
        if every and self.step % every == 0 and self.step < self.cfg.train.steps:
            self.save_checkpoint()
            self.step_gc.at_checkpoint()
        else:
            self.step_gc.after_step(self.step)
        self.console.advance(self.step, rep, self.state.guard_actions)

    def _ran_to_stop(self) -> outcome.Ending:
        if self.step < self.cfg.train.steps:
            return outcome.Ending(schema.STATUS_RUNNING, 0)  # stopped at `until`; resumable
        if self.state.nonfinite_since is not None:
            return outcome.nonfinite(self.state.nonfinite_since, self.state.nonfinite_steps)
        return outcome.Ending(schema.STATUS_FINISHED, 0)

    def goodput(self) -> dict[str, float]:
        """meta.json["goodput"]: goodput, wall_s and the badput split (guard/core/goodput.py); once
        the run has ended, the figure meta.json got (the end-of-run summary prints the same one)."""
        if self.final_goodput is not None:
            return self.final_goodput
        return self.gp.report(time.time())

    def _final_goodput(self) -> dict[str, float]:
        self.final_goodput = self.gp.report(time.time())
        return self.final_goodput

    def _finish(self, end: outcome.Ending) -> None:
        if self.pump is not None:
            self.pump.close()
        self.sync.log.close()
        self.record.finish(
            end.status,
            end.note,
            final_step=self.step,
            counts=self.state.counts,
            guard_actions=self.state.guard_actions,
            goodput=self._final_goodput(),
            nonfinite_steps=self.state.nonfinite_steps,
        )
        if (
            self.dist.world > 1
            and dist.is_initialized()
            and end.status not in (schema.STATUS_CRASHED, schema.STATUS_INTERRUPTED, schema.STATUS_PEER_LOST)
        ):
            self.comm.barrier()  # after a crash, Ctrl-C or a dead peer a peer may be gone: do not wait for it
