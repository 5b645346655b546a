"""On-disk checkpoints: model, optimizer, schedule position, RNG, data position, guard state.

Written to a temporary file and renamed, so a crash mid-save leaves the previous checkpoint
intact; the newest N are kept.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

_CKPT_RE = re.compile(r"step-(\d{9})\.pt$")


def rng_state() -> dict[str, Any]:
    s: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_rng_state(s: dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    np.random.set_state(s["numpy"])
    random.setstate(s["python"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def checkpoint_path(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f"step-{step:09d}.pt"


def save_checkpoint(ckpt_dir: str | Path, step: int, state: dict[str, Any], keep: int = 2) -> Path:
    d = Path(ckpt_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(d, step)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    for old in list_checkpoints(d)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def list_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    d = Path(ckpt_dir)
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if _CKPT_RE.search(p.name))


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    ckpts = list_checkpoints(ckpt_dir)
    return ckpts[-1] if ckpts else None


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    # weights_only=False: the checkpoint holds RNG states and plain dicts we wrote ourselves.
    return torch.load(path, map_location="cpu", weights_only=False)
