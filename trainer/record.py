"""What meta.json says of a run of moeguard's trainer. Where its rows, events and meta.json go
(RunRecord) is guard/runtime/record.py, shared with every integration; re-exported here.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from guard.core import schema
from guard.core.tomlconf import to_dict
from guard.runtime.envinfo import fingerprint
from guard.runtime.record import RunRecord

if TYPE_CHECKING:
    from trainer.view import TrainerView

JOB_KEY = "torchelastic_run_id"  # meta.json: the torchrun job that started the run (kept across its restarts)


def run_meta(t: TrainerView, status: str) -> dict[str, Any]:
    """meta.json of a run that starts now (the run store adds how it ended)."""
    return {
        "run_id": t.run_dir.name,
        "name": t.cfg.name,
        schema.META_TAGS: list(t.cfg.tags),
        "framework": schema.FRAMEWORK_MOEGUARD,
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


def run_environment(t: TrainerView) -> dict[str, Any]:
    """meta.json["env"]: what this run ran on and with (guard/runtime/envinfo.py)."""
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


__all__ = ["JOB_KEY", "RunRecord", "run_environment", "run_meta"]
