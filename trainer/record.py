"""What meta.json says of a run, and where its rows, events and meta.json go: the run store on rank 0 and the exporter on every
rank (both write from background threads and never block a step).

A non-zero rank has no run store; what its exporter sends is its own timing (its heartbeat and
its straggler score at the collector), not the job's report.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from guard.core import schema
from guard.core.events import Event
from guard.core.heartbeat import PHASE_CHECKPOINT, PHASE_TRAIN
from guard.core.report import StepReport
from guard.core.tomlconf import to_dict
from guard.store.reader import read_meta
from guard.store.runstore import RunStore
from guard.store.writer import truncate_after
from trainer.envinfo import fingerprint

if TYPE_CHECKING:
    from trainer.loop import Trainer

JOB_KEY = "torchelastic_run_id"  # meta.json: the torchrun job that started the run (kept across its restarts)


def run_meta(t: Trainer, status: str) -> dict[str, Any]:
    """meta.json of a run that starts now (the run store adds how it ended)."""
    return {
        "run_id": t.run_dir.name,
        "name": t.cfg.name,
        "status": status,
        "started_at": t.gp.started_at,
        "config": to_dict(t.cfg),
        "env": t.env,
        "flops_per_token": t.flops_per_token,
        "model_params": t.model.n_params(),
        "active_params": t.model.n_params(active=True),
        **t.callbacks.meta(),
        JOB_KEY: os.environ.get("TORCHELASTIC_RUN_ID", ""),
    }


def run_environment(t: Trainer) -> dict[str, Any]:
    """meta.json["env"]: what this run ran on and with (trainer/envinfo.py)."""
    return fingerprint(
        device=t.device,
        dtype="bf16-autocast" if t.dtype == torch.bfloat16 else "fp32",
        peak_flops=t.peak,
        peak_source=t.peak_source,
        attention_backend=t.model.attention_backend,
        expert_kernel=t.model.experts_kernel,
        compile=t.cfg.train.compile,
        world_size=t.dist.world,
    )


class RunRecord:
    def __init__(self, run_dir: Path, store: RunStore | None, exporter: Any, *, rank: int) -> None:
        self.run_dir = run_dir
        self.store = store  # rank 0 only
        self.exporter = exporter  # any rank, or None
        self.rank = rank

    def started(self, meta: dict[str, Any], *, restarted: bool) -> None:
        """A new run: meta.json says running (a torchrun restart before the first checkpoint starts clean)."""
        if self.store is None:
            return
        if restarted:
            truncate_after(self.run_dir, -1)
        self.store.write_meta(meta)

    def resumed(
        self,
        step: int,
        checkpoint: Path,
        env: dict[str, Any],
        fresh_meta: Callable[[], dict[str, Any]],
        **detail: Any,
    ) -> None:
        """Rows after the checkpoint's step are dropped (they will be written again), meta.json counts
        the restart, and a resume event says from where (`fresh_meta()`: when meta.json is missing)."""
        if self.store is None:
            return
        dropped = truncate_after(self.run_dir, step - 1)
        meta = read_meta(self.run_dir) or fresh_meta()
        restarts = int(meta.get("restarts", 0)) + 1
        self.store.write_meta({**meta, "status": schema.STATUS_RUNNING, "restarts": restarts, "env": env})
        self.store.add_event(
            Event(
                step=step,
                kind=schema.EV_RESUME,
                detail={
                    "checkpoint": checkpoint.name,
                    "rows_dropped": dropped,
                    "restarts": restarts,
                    **detail,
                },
            )
        )

    def announce(self, fresh_meta: Callable[[], dict[str, Any]]) -> None:
        """The exporter learns the run's meta (rank 0; `fresh_meta()` when meta.json is missing)."""
        if self.exporter is not None and self.rank == 0:
            self.exporter.set_meta(read_meta(self.run_dir) or fresh_meta())

    def step(self, rep: StepReport, events: list[Event], own_wait: float, own_tokens: int) -> None:
        if self.store is not None:
            self.store.add_step(rep)
            for ev in events:
                self.store.add_event(ev)
        if self.exporter is None:
            return
        if self.rank == 0:
            self.exporter.submit(rep, events)
            return
        self.exporter.submit(  # this rank's own timing
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
                rank=self.rank,
                straggler_score=rep.straggler_score,
            )
        )

    # ---- around a checkpoint ------------------------------------------------------------------
    def checkpoint_starts(self) -> None:
        if self.exporter is not None:
            self.exporter.set_phase(PHASE_CHECKPOINT)  # a long save must not look like a hang
        if self.store is not None:  # every row before the checkpoint is on disk before it exists
            self.store.flush(wait=True)

    def checkpoint_saved(self, step: int, path: Path, goodput: Callable[[], dict[str, float]]) -> None:
        if self.exporter is not None:
            self.exporter.set_phase(PHASE_TRAIN)
        if self.store is not None:
            self.store.add_event(Event(step=step, kind=schema.EV_CHECKPOINT, detail={"path": path.name}))
            if self.exporter is not None:
                self.exporter.set_meta({**(read_meta(self.run_dir) or {}), "goodput": goodput()})

    # ---- the end ------------------------------------------------------------------------------
    def finish(self, status: str, note: str, **fields: Any) -> None:
        """meta.json gets how the run ended and its final figures; the exporter sends its last batch."""
        if self.store is not None:
            fields["restarts"] = (read_meta(self.run_dir) or {}).get("restarts", 0)
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
