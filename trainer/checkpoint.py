"""On-disk checkpoints: model and optimizer as torch.distributed.checkpoint (DCP), plus host state.

Layout (one directory per checkpoint, the newest `keep` kept):

    checkpoints/step-000000040/
        .metadata, __<rank>_0.distcp   DCP: model + optimizer state, keyed by parameter name
                                       (get_state_dict), so a checkpoint written by W ranks, with
                                       ddp or fsdp, loads on W' ranks with either, or on one process
        host.pt                        rank 0: the TrainState (step, optimizer step, counters), each
                                       stateful part's state_dict() under its own key (data position,
                                       global so it does not depend on W; guard, probe, straggler,
                                       goodput, callbacks), config, world size, save time
        rng-r<rank>.pt                 each rank's RNG state (a rank missing on resume takes rank 0's)

One format for every world size: DCP runs without a process group (no_dist) in one process, so
single-process runs write the same layout. Written into `.step-XXXXXXXXX.tmp/`; after every rank
has finished, rank 0 fsyncs and renames it, so a crash mid-save leaves the previous checkpoint
as the newest. Single-file `step-XXXXXXXXX.pt` checkpoints written before DCP still load.

The trainer saves and resumes through a `Checkpointer` over its TrainState and its stateful parts:
what a part is and how it saves itself is its own business (a `state_dict()` / `load_state_dict()`
pair).
"""

from __future__ import annotations

import math
import os
import random
import re
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from guard.core import actions, schema

_CKPT_RE = re.compile(r"step-(\d{9})(\.pt)?$")
HOST_FILE = "host.pt"


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(slots=True)
class TrainState:
    """What the loop itself carries from step to step (everything else is a part's own state)."""

    step: int = 0  # iterations run (monotonic; the run store's key)
    opt_step: int = 0  # updates actually applied (drives the LR schedule; restored on rollback)
    counts: dict[str, int] = field(default_factory=lambda: {a: 0 for a in schema.ACTIONS})  # step decisions
    guard_actions: dict[str, int] = field(default_factory=actions.zero)  # guard/core/actions.py's count
    nonfinite_steps: int = 0  # updates applied with a non-finite loss or gradient
    nonfinite_since: int | None = None  # first such update since the weights were last finite

    def track_finite(self, loss: float, grad_norm: float, *, applied: bool) -> bool:
        """Count an update applied with a non-finite loss or gradient (the guard was off or only
        observing); True when this step's loss and gradient were finite."""
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if finite:
            self.nonfinite_since = None  # finite again (e.g. a rollback restored finite weights)
        elif applied:
            self.nonfinite_steps += 1
            if self.nonfinite_since is None:
                self.nonfinite_since = self.step
        return finite

    def to_host(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "opt_step": self.opt_step,
            "counts": dict(self.counts),
            "guard_actions": dict(self.guard_actions),
            "nonfinite": {"steps": self.nonfinite_steps, "since": self.nonfinite_since},
        }

    def load_host(self, host: dict[str, Any]) -> None:
        self.step, self.opt_step = host["step"], host["opt_step"]
        self.counts.update(host.get("counts", {}))
        self.guard_actions.update(host.get("guard_actions", {}))
        nf = host.get("nonfinite", {})
        self.nonfinite_steps, self.nonfinite_since = int(nf.get("steps", 0)), nf.get("since")


@dataclass(slots=True)
class Restored:
    path: Path
    host: dict[str, Any]  # the whole host state (a legacy checkpoint: its one dict)
    legacy: bool  # a single-file checkpoint from before DCP


class Checkpointer:
    """Saves and restores one run: the model and optimizer as DCP, the TrainState and each part's
    state_dict() under its key in host.pt, each rank's RNG. Collective when world > 1 (every rank
    calls save and restore)."""

    def __init__(
        self,
        ckpt_dir: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        state: TrainState,
        parts: dict[str, Stateful],
        *,
        dist: Any,
        keep: int,
        barrier: Callable[[], None] = lambda: None,
    ) -> None:
        """`parts`: everything else with state, by host.pt key; `dist`: this rank's rank and world."""
        self.dir, self.model, self.optimizer = ckpt_dir, model, optimizer
        self.state, self.parts = state, parts
        self.rank, self.world = dist.rank, dist.world
        self.keep, self.barrier = keep, barrier

    def save(self, **extra: Any) -> Path:
        """Checkpoint the TrainState's step; `extra` goes into host.pt beside it (config, world size)."""
        host = None
        if self.rank == 0:  # identical on every rank; rank 0 writes it
            parts = {k: p.state_dict() for k, p in self.parts.items()}
            host = {**self.state.to_host(), **parts, **extra, "saved_at": time.time()}
        return save_checkpoint(
            self.dir,
            self.state.step,
            self.model,
            self.optimizer,
            host,
            rank=self.rank,
            world=self.world,
            keep=self.keep,
            barrier=self.barrier,
        )

    def latest(self) -> Path | None:
        return latest_checkpoint(self.dir)

    def path(self, step: int) -> Path:
        return checkpoint_path(self.dir, step)

    def restore(self, path: Path) -> Restored:
        """Load checkpoint `path` into the model, optimizer, TrainState and every part it holds a
        state for, and set this rank's RNG state (rank 0's when this rank has none): exactly where
        the run was when it saved."""
        legacy = is_legacy(path)
        if legacy:
            host = load_checkpoint(path)
            self.model.load_state_dict(host["model"])
            self.optimizer.load_state_dict(host["optimizer"])
            rng = host["rng"]
        else:
            load_sharded(path, self.model, self.optimizer, world=self.world)
            host, rng = load_host_state(path, self.rank)
        for key, part in self.parts.items():
            if key in host:
                part.load_state_dict(host[key])
        self.state.load_host(host)
        if rng is not None:
            set_rng_state(rng)
        return Restored(path, host, legacy)


def rng_state() -> dict[str, Any]:
    s: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
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
    return ckpt_dir / f"step-{step:09d}"


def _fsync_write(path: Path, obj: Any) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(p: Path) -> None:
    if p.is_dir():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def save_checkpoint(
    ckpt_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    host: dict[str, Any] | None,
    *,
    rank: int = 0,
    world: int = 1,
    keep: int = 2,
    barrier: Callable[[], None] = lambda: None,
) -> Path:
    """Collective when world > 1: every rank calls it; `host` is only used on rank 0."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    d = Path(ckpt_dir)
    final = checkpoint_path(d, step)
    tmp = d / f".{final.name}.tmp"
    if rank == 0:
        d.mkdir(parents=True, exist_ok=True)
        for stale in d.glob(".step-*.tmp"):  # a save that a crash interrupted
            _remove(stale)
        tmp.mkdir()
    barrier()
    msd, osd = get_state_dict(model, optimizer)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=tmp, no_dist=world == 1)
    _fsync_write(tmp / f"rng-r{rank}.pt", rng_state())
    if rank == 0:
        assert host is not None
        _fsync_write(tmp / HOST_FILE, host)
    barrier()
    if rank == 0:
        for f in tmp.iterdir():  # DCP's own files: make them durable before the rename commits
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(tmp)
        if final.exists():  # the same step saved again (a resumed run re-reaching it)
            _remove(final)
        os.replace(tmp, final)
        _fsync_dir(d)
        for old in list_checkpoints(d)[:-keep]:
            _remove(old)
    barrier()
    return final


def list_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first (DCP directories with host state, and legacy .pt files)."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        return []
    out = []
    for p in d.iterdir():
        m = _CKPT_RE.search(p.name)
        if m and not p.name.startswith(".") and (m.group(2) or (p / HOST_FILE).is_file()):
            out.append((int(m.group(1)), p))
    return [p for _, p in sorted(out)]


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    ckpts = list_checkpoints(ckpt_dir)
    return ckpts[-1] if ckpts else None


def load_host_state(path: str | Path, rank: int = 0) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(host state, this rank's RNG state or rank 0's) of a DCP checkpoint directory."""
    p = Path(path)
    # weights_only=False: these files hold RNG states and plain dicts we wrote ourselves.
    host = torch.load(p / HOST_FILE, map_location="cpu", weights_only=False)
    rng_file = p / f"rng-r{rank}.pt"
    if not rng_file.is_file():
        rng_file = p / "rng-r0.pt"
    rng = torch.load(rng_file, map_location="cpu", weights_only=False) if rng_file.is_file() else None
    return host, rng


def load_sharded(
    path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, *, world: int = 1
) -> None:
    """Load model + optimizer from a DCP checkpoint into this rank's (possibly sharded) layout."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optimizer": osd}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=Path(path), no_dist=world == 1)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def is_legacy(path: str | Path) -> bool:
    return Path(path).suffix == ".pt"


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """A legacy single-file checkpoint (model, optimizer, host state in one dict)."""
    return torch.load(path, map_location="cpu", weights_only=False)
