"""The guarded training loop.

One step:
    data (timed) -> forward/backward over micro-batches -> [gradient all-reduce (ddp)]
    -> Probe.collect: every statistic reduced across ranks in one all-reduce, one device->host copy
    -> Guard.observe: the engine (detectors + policy + the pending operator command) -> Decision
    -> [ranks agree: one tiny MAX all-reduce of the decision's fingerprint and the next command]
    -> DecisionApplier (guard/runtime/apply.py): clip, LR, optimizer.step, expert-bias update
       (trainer/correction.py) | skip | roll back | halt
    -> run store (rank 0) / exporter (every rank; background threads; never block the step)
    -> every telemetry.straggler_every steps: ONE all_gather of each rank's timing summary

Multi-rank details (parallel modes, why every rank decides the same, heartbeats) are in
trainer/distributed.py; checkpoint layout in trainer/checkpoint.py; goodput in guard/core/goodput.py.
"""

from __future__ import annotations

import math
import os
import resource
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from guard.core import actions, schema
from guard.core.events import Event
from guard.core.goodput import Goodput
from guard.core.heartbeat import PHASE_CHECKPOINT, PHASE_TRAIN
from guard.core.policy import Decision
from guard.core.report import StepReport
from guard.core.tomlconf import ConfigError, to_dict
from guard.runtime.apply import DecisionApplier
from guard.runtime.guard import Guard
from guard.runtime.probe import Probe
from guard.store.reader import read_meta
from guard.store.runstore import RunStore
from guard.store.writer import truncate_after
from trainer import checkpoint as ckpt
from trainer.config import TrainConfig
from trainer.correction import ModelCorrector
from trainer.data import DataLoader
from trainer.distributed import (
    Comm,
    Dist,
    HeartbeatPump,
    StepSync,
    allreduce_grads,
    resolve_parallel,
    restart_count,
    setup_distributed,
    shard_fsdp,
)
from trainer.envinfo import fingerprint
from trainer.flops import flops_per_token, peak_flops
from trainer.inject import Injection, Injector
from trainer.model import MoETransformer

__all__ = [
    "EXIT_HALTED",
    "EXIT_PREEMPTED",
    "Dist",
    "Trainer",
    "allreduce_grads",
    "build_optimizer",
    "lr_at",
    "setup_distributed",
]

EXIT_HALTED = 3  # the guard halted the run (a checkpoint and a critical event were written)
# SIGTERM (preemption): checkpoint, then exit 128 + SIGTERM, what a process killed by SIGTERM reports.
# Not 0: Kubernetes Jobs, Slurm --requeue and torchrun restarts treat 0 as "done" and would not
# requeue a run that still has steps to go; 143 reads as "terminated", and --resume continues it.
EXIT_PREEMPTED = 128 + signal.SIGTERM
EXIT_INTERRUPTED = 128 + signal.SIGINT  # Ctrl-C (the shell's convention)

# meta.json["status"] values the trainer writes beside schema.RUN_STATUSES (readers show any
# status string as it is; meta.json["status_note"] says what happened in words).
STATUS_PREEMPTED = "preempted"  # SIGTERM: checkpointed at a step boundary, resumable
STATUS_INTERRUPTED = "interrupted"  # Ctrl-C / SIGINT: stopped where it was, no new checkpoint
STATUS_FINISHED_NONFINITE = "finished_nonfinite"  # ran to the end, but its loss/gradient ended non-finite
JOB_KEY = "torchelastic_run_id"  # meta.json: the torchrun job that started the run (kept across its restarts)


def lr_at(opt_step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to lr * min_lr_ratio at the last step."""
    o = cfg.optim
    if opt_step < o.warmup_steps:
        return o.lr * (opt_step + 1) / o.warmup_steps
    span = max(1, cfg.train.steps - o.warmup_steps)
    frac = min(1.0, (opt_step - o.warmup_steps) / span)
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    # Decay matrices only (norm gains and embeddings' rows are left alone, as in nanoGPT).
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2 and "embed" not in n]
    rest = [
        p for n, p in model.named_parameters() if p.requires_grad and not (p.ndim >= 2 and "embed" not in n)
    ]
    o = cfg.optim
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        foreach=True,
    )


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # Linux reports KiB


def set_deterministic(compile: bool) -> None:
    if compile:
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        # The same switch without importing torch._inductor (4 s per process) to set its flag.
        torch._C._set_deterministic_algorithms(True, warn_only=True)


def unavailable_backend(e: ValueError, cfg: TrainConfig, device: torch.device, dtype: torch.dtype) -> str:
    """'model.attention = 'cudnn' is not available on cpu ...; available here: auto, math, flash'."""
    from trainer.model import ATTENTION_CHOICES, resolve_attention_backend

    msg = f"model.{e}"
    if str(e).startswith("attention="):
        ok = []
        for name in ATTENTION_CHOICES:
            try:
                resolve_attention_backend(
                    name,
                    device,
                    dtype,
                    n_heads=cfg.model.n_heads,
                    head_dim=cfg.model.head_dim,
                    seq_len=cfg.model.max_seq_len,
                )
                ok.append(name)
            except ValueError:
                pass
        msg += f"; available here: {', '.join(ok) or 'none'} (set it with --set model.attention=...)"
    return msg


def _evidence(ev: Event) -> str:
    """'grad_norm_spike = 45.3 (threshold 3.1)', 'nonfinite grad_norm layers [1]': a verdict in a few words."""
    d = ev.detail
    where = f" layer {d['layer']}" if "layer" in d else (f" layers {d['layers']}" if d.get("layers") else "")
    if ev.detector == schema.DET_NONFINITE:
        return f"{ev.detector} {'/'.join(d.get('signals') or [])}{where}".replace("  ", " ")
    value = f" = {ev.value:.4g}" if math.isfinite(ev.value) else ""
    limit = f" (threshold {ev.threshold:.4g})" if math.isfinite(ev.threshold) else ""
    return f"{ev.detector}{where}{value}{limit}"


def action_lines(step: int, action: str, events: list[Event]) -> list[str]:
    """One concise line per thing the guard did at `step`: the action, the detector and its evidence."""
    out = []
    if action in (schema.ACT_SKIP, schema.ACT_ROLLBACK, schema.ACT_HALT):
        why = [_evidence(e) for e in events if e.kind == schema.EV_VERDICT and e.action == action]
        what = action
        for e in events:
            if e.kind == schema.EV_ACTION and e.action == schema.ACT_ROLLBACK:
                what = (
                    f"rollback to the snapshot of step {e.detail.get('restored_step', '?')}, "
                    f"{e.detail.get('skip_batches', 0)} batches skipped"
                )
                why = why or [str(e.detail.get("reason", ""))]
            elif e.kind == schema.EV_ACTION and e.action == schema.ACT_LR_COOLDOWN:
                what += f", LR x{e.value:g} for {e.detail.get('steps')} steps"
            elif e.kind == schema.EV_HALT:
                what, why = "halt", [str(e.detail.get("reason", ""))]
            elif e.kind == schema.EV_OPERATOR:
                why = why or [f"operator command ({e.detail.get('reason') or 'no reason given'})"]
        out.append(f"guard step {step}: {what} <- {'; '.join(w for w in why if w) or 'policy'}")
    for e in events:
        if e.kind == schema.EV_ACTION and e.action == schema.ACT_BIAS_CORRECT:
            d = e.detail
            out.append(
                f"guard step {step}: {e.action} layer {d.get('layer')} ({d.get('mode')} boost x{d.get('boost', 0):g} "
                f"until step {d.get('until')}) <- {_evidence(e)}"
            )
        elif e.kind == schema.EV_RECOVERED:
            out.append(
                f"guard step {step}: layer {e.detail.get('layer')} recovered from {e.detector} "
                f"after {e.detail.get('corrected_for')} steps"
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
    ) -> None:
        self._t_start = time.time()
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.dist, self.device = setup_distributed(cfg.train.device)
        self.parallel = resolve_parallel(cfg.train.parallel, self.dist.world)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        if cfg.train.deterministic and self.device.type == "cpu":
            set_deterministic(cfg.train.compile)
        self.dtype = self._dtype()
        torch.manual_seed(cfg.train.seed)
        try:
            self.model = MoETransformer(cfg.model, device=self.device, compute_dtype=self.dtype)
        except ValueError as e:  # a kernel choice this device, dtype or torch build cannot run
            if not str(e).startswith(("attention=", "experts_kernel=")):
                raise
            raise ConfigError(unavailable_backend(e, cfg, self.device, self.dtype)) from None
        if self.parallel == "fsdp":
            shard_fsdp(self.model)  # before anything holds parameter references
        self.fwd = torch.compile(self.model) if cfg.train.compile else self.model
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = build_optimizer(self.model, cfg)
        self.data = DataLoader(
            cfg.data,
            vocab_size=cfg.model.vocab_size,
            seed=cfg.train.seed,
            rank=self.dist.rank,
            world_size=self.dist.world,
        )
        self.telemetry = cfg.telemetry.enabled
        self.comm = Comm(self.dist.world)
        self.probe = Probe(self.model, dead_window=cfg.telemetry.dead_window, device=self.device)
        self.probe.all_reduce = self.comm.all_reduce
        self.guard = Guard(
            cfg.guard, self.model, self.opt, max_lr=cfg.optim.lr, has_bias=cfg.model.bias_mode != "off"
        )
        corrector = ModelCorrector(
            self.model,
            self.probe.routers,
            bias=cfg.model.bias_mode != "off",
            bias_max=cfg.guard.policy.bias_max,
            aux_coef=cfg.model.aux_loss_coef,
        )
        self.applier = DecisionApplier(
            self.opt, self.guard, grad_clip=cfg.optim.grad_clip, corrector=corrector
        )
        self.injector = Injector(injections or [], rank=self.dist.rank, attempt=restart_count())
        self.opt_step = 0  # updates actually applied (drives the LR schedule; restored on rollback)
        self.step = 0  # iterations run (monotonic; the run store's key)
        self.progress = progress and self.dist.main
        self.exporter = exporter
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)
        self.peak, self.peak_source = peak_flops(self.device, self.dtype)
        self.counts = {a: 0 for a in schema.ACTIONS}  # step decisions, apply included
        self.guard_actions = (
            actions.zero()
        )  # what guard/core/actions.py counts (the CLI, meta, app, /metrics)
        self.gp = Goodput(started_at=self._t_start)
        self.probe_layer_ids = np.arange(len(self.model.blocks), dtype=np.int32)
        self.last_decision: Decision | None = None
        self.nonfinite_steps = 0  # updates applied with a non-finite loss or gradient
        self.nonfinite_since: int | None = None  # first such update since the weights were last finite
        self.stop_requested = False  # SIGTERM arrived (set by the handler, acted on at a step boundary)
        self.stop_agreed = False  # every rank saw it (it rides in the probe's all-reduce)
        self.last_checkpoint: Path | None = None
        self._bar: Any = None
        # multi-rank: decision agreement, operator commands, straggler windows, heartbeats
        self.sync = StepSync(
            self.dist,
            self.comm,
            self.device,
            straggler_every=cfg.telemetry.straggler_every,
            straggler_threshold=cfg.telemetry.straggler_threshold,
            exporter=exporter,
            commands=self.guard.commands,
        )
        # one rank too: `--inject hang@S:SECONDS` blocks inside comm.timed() like a hung collective
        self.pump = HeartbeatPump(self.comm, exporter) if exporter is not None else None
        self.store = RunStore(self.run_dir, flush_every=cfg.telemetry.flush_every) if self.dist.main else None
        self.env = fingerprint(
            device=self.device,
            dtype=self._dtype_name(),
            peak_flops=self.peak,
            peak_source=self.peak_source,
            attention_backend=self.model.attention_backend,
            expert_kernel=self.model.experts_kernel,
            compile=cfg.train.compile,
            world_size=self.dist.world,
        )
        self.env["parallel"] = self.parallel
        if resume:
            self._resume()
        elif self.store is not None:
            if restart_count() > 0:  # torchrun restarted us before the first checkpoint: start clean
                truncate_after(self.run_dir, -1)
            self.store.write_meta(self._meta(schema.STATUS_RUNNING))
        if self.exporter is not None and self.dist.main:
            self.exporter.set_meta(read_meta(self.run_dir) or self._meta(schema.STATUS_RUNNING))

    # ---- setup helpers ------------------------------------------------------------------
    def _dtype(self) -> torch.dtype:
        want = self.cfg.train.dtype
        if want == "bf16" or (want == "auto" and self.device.type == "cuda"):
            return torch.bfloat16
        return torch.float32

    def _dtype_name(self) -> str:
        return "bf16-autocast" if self.dtype == torch.bfloat16 else "fp32"

    def _meta(self, status: str, **extra: Any) -> dict[str, Any]:
        return {
            "run_id": self.run_dir.name,
            "name": self.cfg.name,
            "status": status,
            "started_at": self.gp.started_at,
            "config": to_dict(self.cfg),
            "env": self.env,
            "flops_per_token": self.flops_per_token,
            "model_params": self.model.n_params(),
            "active_params": self.model.n_params(active=True),
            "injections": [str(i) for s in self.injector.by_step.values() for i in s],
            JOB_KEY: os.environ.get("TORCHELASTIC_RUN_ID", ""),
            **extra,
        }

    # ---- checkpoints --------------------------------------------------------------------
    def _host_state(self) -> dict[str, Any]:
        """Everything but the model and optimizer (those go to DCP); identical on every rank."""
        return {
            "step": self.step,
            "opt_step": self.opt_step,
            "data": self.data.state_dict(),
            "guard": self.guard.state_dict(),
            "probe": self.probe.state_dict(),
            "sync": self.sync.state_dict(),
            "counts": dict(self.counts),
            "guard_actions": dict(self.guard_actions),
            "nonfinite": {"steps": self.nonfinite_steps, "since": self.nonfinite_since},
            "goodput": self.gp.state_dict(),
            "config": to_dict(self.cfg),
            "world_size": self.dist.world,
            "parallel": self.parallel,
            "saved_at": time.time(),
        }

    def save_checkpoint(self) -> Path:
        t0 = time.perf_counter()
        if self.exporter is not None:
            self.exporter.set_phase(PHASE_CHECKPOINT)  # a long save must not look like a hang
        if self.store is not None:  # every row before the checkpoint is on disk before it exists
            self.store.flush(wait=True)
        multi = self.dist.world > 1
        path = ckpt.save_checkpoint(
            self.run_dir / schema.CHECKPOINT_DIR,
            self.step,
            self.model,
            self.opt,
            self._host_state() if self.dist.main else None,
            rank=self.dist.rank,
            world=self.dist.world,
            keep=self.cfg.train.keep_checkpoints,
            barrier=self.comm.barrier if multi else lambda: None,
        )
        self.gp.add("checkpoint_s", time.perf_counter() - t0)
        self.last_checkpoint = path
        if self.exporter is not None:
            self.exporter.set_phase(PHASE_TRAIN)
        if self.store is not None:
            self.store.add_event(Event(step=self.step, kind=schema.EV_CHECKPOINT, detail={"path": path.name}))
            if self.exporter is not None:
                self.exporter.set_meta({**(read_meta(self.run_dir) or {}), "goodput": self.goodput()})
        return path

    def _resume(self) -> None:
        path = ckpt.latest_checkpoint(self.run_dir / schema.CHECKPOINT_DIR)
        if path is None:
            raise ConfigError(f"--resume: no checkpoint in {self.run_dir / schema.CHECKPOINT_DIR}")
        self.last_checkpoint = path
        if ckpt.is_legacy(path):  # one torch.save file from before DCP
            s = ckpt.load_checkpoint(path)
            self.model.load_state_dict(s["model"])
            self.opt.load_state_dict(s["optimizer"])
            host, rng = s, s["rng"]
            self.gp.split.update(s.get("time_split", {}))
        else:
            ckpt.load_sharded(path, self.model, self.opt, world=self.dist.world)
            host, rng = ckpt.load_host_state(path, self.dist.rank)
            self.gp.load_state_dict(host.get("goodput", {}))
            self.gp.resumed(float(host.get("saved_at", self._t_start)), self._t_start)
            self.sync.load_state_dict(host.get("sync", {}))
        self.data.load_state_dict(host["data"])
        self.guard.load_state_dict(host["guard"])
        self.probe.load_state_dict(host["probe"])
        self.step, self.opt_step = host["step"], host["opt_step"]
        self.counts.update(host.get("counts", {}))
        self.guard_actions.update(host.get("guard_actions", {}))
        nf = host.get("nonfinite", {})
        self.nonfinite_steps, self.nonfinite_since = int(nf.get("steps", 0)), nf.get("since")
        if rng is not None:
            ckpt.set_rng_state(rng)
        if self.store is not None:
            dropped = truncate_after(self.run_dir, self.step - 1)
            meta = read_meta(self.run_dir) or self._meta(schema.STATUS_RUNNING)
            restarts = int(meta.get("restarts", 0)) + 1
            self.store.write_meta(
                {**meta, "status": schema.STATUS_RUNNING, "restarts": restarts, "env": self.env}
            )
            self.store.add_event(
                Event(
                    step=self.step,
                    kind=schema.EV_RESUME,
                    detail={
                        "checkpoint": path.name,
                        "rows_dropped": dropped,
                        "restarts": restarts,
                        "world_size": self.dist.world,
                        "saved_world_size": host.get("world_size", 1),
                    },
                )
            )

    # ---- one step -----------------------------------------------------------------------
    def _batches(self) -> tuple[list[torch.Tensor], float]:
        if (inj := self.injector.due(self.step, "stall")) is not None:
            self.data.stall_next_s = inj.arg
        t0 = time.perf_counter()
        batches = [self.data.next_batch() for _ in range(self.cfg.train.grad_accum)]
        wait = time.perf_counter() - t0
        if self.injector.due(self.step, "badbatch") is not None:
            batches = [Injector.garbage_batch(b, self.cfg.model.vocab_size, self.step) for b in batches]
        return [b.to(self.device, non_blocking=True) for b in batches], wait

    def _forward_backward(self, batches: list[torch.Tensor]) -> torch.Tensor:
        self.model.train()
        loss_sum = torch.zeros((), device=self.device)
        n = len(batches)
        for b in batches:
            x, y = b[:, :-1], b[:, 1:]
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.dtype == torch.bfloat16):
                logits, aux = self.fwd(x)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
            ((loss + aux) / n).backward()
            loss_sum += loss.detach()
        return loss_sum

    def _inject_into_grads(self) -> None:
        if (inj := self.injector.due(self.step, "gradspike")) is not None:
            Injector.scale_grads(self.params, inj.arg)
        if self.injector.due(self.step, "nan") is not None:
            Injector.poison_grad(self.model)
        if (inj := self.injector.due(self.step, "collapse")) is not None:
            Injector.collapse(self.model, int(inj.arg))

    def _reduce_grads(self) -> None:
        if self.parallel == "ddp":
            allreduce_grads(self.params, self.dist.world, self.comm)
        # fsdp: reduce-scattered inside backward; none: nothing to do

    def plain_step(self) -> StepReport:
        """Telemetry off: the loop any PyTorch user writes (the overhead benchmark's baseline)."""
        t0 = time.perf_counter()
        batches, data_wait = self._batches()
        loss_sum = self._forward_backward(batches)
        self._reduce_grads()
        if self.cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.optim.grad_clip, foreach=True)
        lr = lr_at(self.opt_step, self.cfg)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        self.opt_step += 1
        if self.probe.routers and self.cfg.model.bias_mode != "off":
            loads, _, _ = self.probe.reduced_router_stats()
            for m, (_, router) in enumerate(self.probe.routers):
                router.update_bias(loads[m])
        self.opt.zero_grad(set_to_none=True)
        self.probe.reset_router_stats()
        loss = loss_sum.item() / len(batches)
        dt = time.perf_counter() - t0
        tokens = sum(b.numel() - b.size(0) for b in batches) * self.dist.world
        self._track_finite(loss, 0.0, applied=True)  # no grad norm measured here: the loss says it
        self.stop_agreed = self.stop_requested and self.dist.world == 1
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

    def train_step(self) -> StepReport:
        if not self.telemetry:
            return self.plain_step()
        t0 = time.perf_counter()
        self.comm.take_wait()
        for inj in self.injector.at(self.step):
            if inj.kind == "crash":
                Injector.crash()
            if inj.kind == "hang" and inj.arg > 0:
                with self.comm.timed():  # as if blocked in a collective: the HeartbeatPump beats on
                    Injector.block(inj.arg)
            elif inj.kind == "hang":
                Injector.hang()
        batches, data_wait = self._batches()
        loss_sum = self._forward_backward(batches)
        if (slow := self.injector.slow_s(self.step)) > 0:
            time.sleep(slow)  # a slow device: more compute time on this rank only
        self._inject_into_grads()  # this rank's gradients, before the reduction spreads them
        self._reduce_grads()
        planned_lr = lr_at(self.opt_step, self.cfg)
        if (inj := self.injector.due(self.step, "lrspike")) is not None:
            planned_lr *= inj.arg
        world, rank = self.dist.world, self.dist.rank
        # each rank's data wait rides in the probe's all-reduce as a one-hot; the guard sees the
        # slowest rank's (the step waited for it), so its stall verdict is the same on every rank
        # (the last element: 1 on a rank that got SIGTERM, so all ranks stop at the same step)
        onehot = torch.zeros(world + 1, device=self.device) if world > 1 else None
        if onehot is not None:
            onehot[rank] = data_wait
            onehot[world] = float(self.stop_requested)
        pr = self.probe.collect(loss_sum, len(batches), extra=onehot)
        job_wait = float(pr.extra[:world].max()) if world > 1 else data_wait
        self.stop_agreed = bool(pr.extra[world] > 0) if world > 1 else self.stop_requested
        own_tokens = sum(b.numel() - b.size(0) for b in batches)
        rep = StepReport(
            step=self.step,
            time=time.time(),
            loss=pr.loss,
            grad_norm=pr.grad_norm,
            lr=planned_lr,
            tokens=own_tokens * world,
            data_wait_s=job_wait,
            rank=rank,
            layer_ids_L=self.probe_layer_ids,
            layer_grad_norm_L=pr.layer_grad_norm_L,
            moe_layer_ids_M=self.probe.moe_ids_M,
            router_entropy_M=pr.router_entropy_M,
            load_entropy_M=pr.load_entropy_M,
            maxvio_M=pr.maxvio_M,
            dead_experts_M=pr.dead_experts_M,
            bias_norm_M=pr.bias_norm_M,
            load_ME=pr.load_ME,
            bias_ME=pr.bias_ME,
        )
        if world == 1:
            # Provisional throughput (time so far) so the throughput detector sees this step; with
            # several ranks each would see its own clock, so there the collector watches throughput.
            elapsed = time.perf_counter() - t0
            rep.step_time_s, rep.tokens_per_s = elapsed, rep.tokens / elapsed
        # the operator command agreed at the previous step is merged into this step's decision
        decision = self.guard.observe(rep, lr=planned_lr, command=self.sync.take_pending())
        events = list(decision.events)
        decision = self.sync.agree(self.step, decision, events)
        rep.lr = planned_lr * decision.lr_scale
        for inj in self.injector.at(self.step):
            events.insert(0, Event(step=self.step, kind=schema.EV_INJECT, detail={"injection": str(inj)}))
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
        self.counts[decision.action] = self.counts.get(decision.action, 0) + 1
        actions.tally(self.guard_actions, decision.action, events)
        finite = self._track_finite(rep.loss, rep.grad_norm, applied=decision.applies_update)
        self.gp.step(decision.applies_update, rep.step_time_s, rep.data_wait_s, finite=finite)
        if self.dist.main:
            for line in action_lines(self.step, decision.action, events):
                self.say(line)
        # busy = the step minus the time spent inside collectives (waiting for peers included)
        busy = rep.step_time_s - self.comm.take_wait()
        events.extend(self.sync.end_step(self.step, busy, data_wait, own_tokens, self.store))
        rep.straggler_score = self.sync.straggler_score
        self._emit(rep, events, data_wait, own_tokens)
        self.last_decision = decision
        return rep

    def _track_finite(self, loss: float, grad_norm: float, *, applied: bool) -> bool:
        """Count updates applied with a non-finite loss or gradient (the guard was off or observing);
        True when this step's loss and gradient were finite."""
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if finite:
            self.nonfinite_since = None  # finite again (e.g. a rollback restored finite weights)
        elif applied:
            self.nonfinite_steps += 1
            if self.nonfinite_since is None:
                self.nonfinite_since = self.step
                if self.dist.main:
                    self.say(
                        f"step {self.step}: loss {loss:.4g}, grad norm {grad_norm:.4g}: a non-finite update "
                        f"was applied ({'guard in observe mode' if self.telemetry else 'telemetry off'}); "
                        "the weights are likely non-finite from here"
                    )
        return finite

    def say(self, line: str) -> None:
        """A line for the user on stderr, above the progress bar (tqdm.write keeps the bar whole)."""
        if self._bar is not None:
            type(self._bar).write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    # ---- multi-rank pieces of the step ----------------------------------------------------
    def _emit(self, rep: StepReport, events: list[Event], own_wait: float, own_tokens: int) -> None:
        if self.store is not None:
            self.store.add_step(rep)
            for ev in events:
                self.store.add_event(ev)
        if self.exporter is None:
            return
        if self.dist.main:
            self.exporter.submit(rep, events)
        else:  # this rank's own timing: its heartbeat and its straggler score at the collector
            self.exporter.submit(
                StepReport(
                    step=rep.step,
                    time=rep.time,
                    loss=rep.loss,
                    grad_norm=rep.grad_norm,
                    lr=rep.lr,
                    tokens=own_tokens,
                    step_time_s=rep.step_time_s,
                    data_wait_s=own_wait,
                    tokens_per_s=own_tokens / rep.step_time_s,
                    action=rep.action,
                    rank=self.dist.rank,
                    straggler_score=rep.straggler_score,
                )
            )

    # ---- the loop -----------------------------------------------------------------------
    def run(self, until: int | None = None) -> int:
        """Train to cfg.train.steps (or stop early at `until`, checkpointed, e.g. for a job's time
        slice). Returns 0, EXIT_HALTED if the guard (or an operator) halted the run, EXIT_PREEMPTED
        after a SIGTERM (checkpointed at the step boundary; --resume continues), or raises.

        meta.json["status"] says how it ended: finished, finished_nonfinite (the last updates were
        non-finite: the weights are not usable), halted, preempted, interrupted (Ctrl-C), crashed,
        or running (stopped at `until`); meta.json["status_note"] says it in words."""
        stop = min(until, self.cfg.train.steps) if until is not None else self.cfg.train.steps
        self.gp.add("startup_s", time.time() - self._t_start)
        self._bar = bar = self._progress_bar()
        prof = self._profiler()
        previous = self._catch_sigterm()
        status, code, note = schema.STATUS_FINISHED, 0, ""
        try:
            while self.step < stop:
                rep = self.train_step()
                self.step += 1
                if prof is not None:
                    prof.step()
                if self.last_decision is not None and self.last_decision.halt:
                    status, code = schema.STATUS_HALTED, EXIT_HALTED
                    self.save_checkpoint()
                    why = next(
                        (
                            str(e.detail.get("reason", ""))
                            for e in self.last_decision.events
                            if e.kind == schema.EV_HALT
                        ),
                        "an operator command",
                    )
                    note = (
                        f"halted at step {self.step - 1}: {why}; checkpoint {self.last_checkpoint.name}; "
                        "look at the halt event, then continue with --resume"
                    )
                    break
                if self.stop_agreed if self.dist.world > 1 else self.stop_requested:
                    status, code = STATUS_PREEMPTED, EXIT_PREEMPTED
                    if self.last_checkpoint != ckpt.checkpoint_path(
                        self.run_dir / schema.CHECKPOINT_DIR, self.step
                    ):
                        self.save_checkpoint()
                    note = (
                        f"SIGTERM (preemption): stopped after step {self.step - 1} with checkpoint "
                        f"{self.last_checkpoint.name if self.last_checkpoint else '-'}; continue with --resume"
                    )
                    if self.dist.main:
                        self.say(f"moeguard train: {note}")
                    break
                if self.guard.after_step(self.step, {"opt_step": self.opt_step}):
                    self.sync.log.write(f"{self.step} snapshot")
                    self.gp.snapshot_taken(
                        self.step, set(self.guard.ring.steps()) if self.guard.ring else set()
                    )
                every = self.cfg.train.checkpoint_every
                if every and self.step % every == 0 and self.step < self.cfg.train.steps:
                    self.save_checkpoint()
                if bar is not None:
                    bar.update(1)
                    if self.step % 5 == 0 or self.step == self.cfg.train.steps:
                        bar.set_postfix_str(self._postfix(rep), refresh=False)
            else:
                self.save_checkpoint()
                if self.step < self.cfg.train.steps:
                    status = schema.STATUS_RUNNING  # stopped at --until; resumable
                elif self.nonfinite_since is not None:
                    status = STATUS_FINISHED_NONFINITE
                    note = (
                        f"loss/grad norm non-finite from step {self.nonfinite_since} to the end "
                        f"({self.nonfinite_steps} non-finite updates applied): the weights are not usable; "
                        "rerun from a checkpoint before that step with the guard on"
                    )
        except KeyboardInterrupt:
            status, code = STATUS_INTERRUPTED, EXIT_INTERRUPTED
            last = self.last_checkpoint.name if self.last_checkpoint else "none yet"
            note = f"interrupted (Ctrl-C / SIGINT) during step {self.step}; newest checkpoint: {last}" + (
                "; continue with --resume" if self.last_checkpoint else ""
            )
            raise
        except BaseException as e:
            status, code = schema.STATUS_CRASHED, 1
            note = f"crashed during step {self.step}: {type(e).__name__}: {e}"[:500]
            raise
        finally:
            if prof is not None:
                prof.stop()
            if bar is not None:
                bar.close()
            self._bar = None
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            self._finish(status, note)
        return code

    def _catch_sigterm(self) -> Any:
        """SIGTERM (a scheduler preempting the job; torchrun forwards it to every rank and waits
        30 s before SIGKILL) only sets a flag: the loop finishes the step, checkpoints and exits.
        Returns the previous handler (None when not installed: off the main thread, or multi-rank
        with telemetry off, where no per-step all-reduce could carry the flag to every rank)."""
        if threading.current_thread() is not threading.main_thread():
            return None
        if self.dist.world > 1 and not self.telemetry:
            return None

        def on_sigterm(signum: int, frame: Any) -> None:
            self.stop_requested = True

        return signal.signal(signal.SIGTERM, on_sigterm)

    def _postfix(self, rep: StepReport) -> str:
        mfu = f"{rep.mfu * 100:.2f}%" if math.isfinite(rep.mfu) else "n/a"
        acts = actions.total(self.guard_actions)
        return f"loss {rep.loss:.3f} | {rep.tokens_per_s:,.0f} tok/s | MFU {mfu} | guard actions {acts}"

    def _progress_bar(self) -> Any:
        if not self.progress:
            return None
        from tqdm import tqdm

        return tqdm(
            total=self.cfg.train.steps,
            initial=self.step,
            desc=self.run_dir.name,
            unit="step",
            file=sys.stderr,
            dynamic_ncols=True,
            mininterval=0.5,
        )

    def _profiler(self) -> Any:
        t = self.cfg.telemetry
        if not (t.profile and self.dist.main and self.telemetry):
            return None
        # kineto prints "USDT: ... profiler_start/profiler_stop" (its level 5) to stderr, through the
        # progress bar; 6 silences it (and kineto's own errors: set KINETO_LOG_LEVEL=4 to see those).
        # Read when the profiler first starts, so setting it here is in time.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        prof = profile(
            activities=acts,
            schedule=schedule(
                wait=t.profile_wait, warmup=t.profile_warmup, active=t.profile_active, repeat=1
            ),
            on_trace_ready=tensorboard_trace_handler(str(self.run_dir / schema.PROFILE_DIR)),
        )
        prof.start()
        return prof

    @property
    def time_split(self) -> dict[str, float]:
        return self.gp.split

    def goodput(self) -> dict[str, float]:
        """meta.json["goodput"]: goodput, wall_s and the badput split (guard/core/goodput.py)."""
        return self.gp.report(time.time())

    def _finish(self, status: str, note: str = "") -> None:
        if self.pump is not None:
            self.pump.close()
        self.sync.log.close()
        if self.store is not None:
            last = read_meta(self.run_dir) or {}
            fields = dict(
                final_step=self.step,
                counts=self.counts,
                guard_actions=self.guard_actions,
                goodput=self.goodput(),
                nonfinite_steps=self.nonfinite_steps,
                restarts=last.get("restarts", 0),
            )
            try:
                self.store.close(status=status, status_note=note, **fields)
            except RuntimeError as e:
                # polars answers Ctrl-C with a KeyboardInterrupt in whichever thread runs its query,
                # so the run store's writer can lose the chunk it was writing. Say so, and still
                # record how the run ended (the writer reported its error once and carries on).
                if not isinstance(e.__cause__, KeyboardInterrupt):
                    raise
                note += "; Ctrl-C also interrupted the run store's writer: one chunk of rows may be missing"
                self.store.close(status=status, status_note=note.lstrip("; "), **fields)
            if self.exporter is not None:
                self.exporter.set_meta(read_meta(self.run_dir) or {})
        if self.exporter is not None:
            # a crash sends no final batch, so its silence pages; a Ctrl-C or SIGTERM was on purpose
            self.exporter.close(timeout=30, final=status != schema.STATUS_CRASHED)
        if (
            self.dist.world > 1
            and dist.is_initialized()
            and status not in (schema.STATUS_CRASHED, STATUS_INTERRUPTED)
        ):
            self.comm.barrier()  # after a crash or Ctrl-C a peer may be gone: do not wait for it
