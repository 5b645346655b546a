"""TrainerView: what the callbacks (trainer/callbacks/) and meta.json (trainer/record.py) read of
moeguard's Trainer (trainer/loop.py). Named here, below the loop, so that they do not import the
loop that calls them (no import circle: tests/test_layering.py). trainer.loop.Trainer satisfies it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from guard.core.goodput import Goodput
    from guard.runtime.ranks import Comm, Dist
    from trainer.config import TrainConfig
    from trainer.data import DataLoader
    from trainer.model import MoETransformer


class HasMeta(Protocol):
    def meta(self) -> dict[str, Any]:
        """What the trainer's callbacks add to meta.json (trainer.callbacks.Callbacks.meta)."""
        ...


class TrainerView(Protocol):
    cfg: TrainConfig
    run_dir: Path
    device: torch.device
    dtype: torch.dtype
    dist: Dist
    comm: Comm
    model: MoETransformer
    params: list[nn.Parameter]
    data: DataLoader
    env: dict[str, Any]
    flops_per_token: float
    peak: float | None
    peak_source: str
    gp: Goodput
    callbacks: HasMeta
