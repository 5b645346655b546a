"""Before `moeguard train --resume` touches a run store: is it whole enough to continue?

The resume path rewrites the store (rows after the checkpoint's step are dropped, meta.json counts
the restart); a damaged part or a meta.json of the wrong shape ended that in a Python traceback
from deep inside polars or int() (issue #32). Checked first, cheaply (part footers only): one line
naming the file and what to do, exit 2, nothing changed.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import polars as pl

from guard.core import schema
from guard.core.tomlconf import ConfigError
from guard.store.layout import part_files

# What loading a damaged checkpoint raises (DCP wraps the reader's error in CheckpointException).
_LOAD_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    RuntimeError,
    ValueError,
    EOFError,
    KeyError,
    pickle.UnpicklingError,
)


def restore_checked(checkpoints: Any, path: Path, run_dir: Path, *, check_store: bool) -> Any:
    """`checkpoints.restore(path)` for --resume, after `check_store_for_resume` (on the rank that
    writes the store): a damaged store or checkpoint is one line naming it (ConfigError)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if check_store:
        check_store_for_resume(run_dir)  # before anything changes
    try:
        return checkpoints.restore(path)
    except (*_LOAD_ERRORS, CheckpointException) as e:
        last = ([ln.strip() for ln in str(e).splitlines() if ln.strip()] or [""])[-1]  # DCP nests tracebacks
        raise ConfigError(
            f"--resume: checkpoint {path} cannot be loaded ({type(e).__name__}: {last[:160]}); "
            "move it aside to resume from the one before it"
        ) from None


def check_store_for_resume(run_dir: Path) -> None:
    """ConfigError naming the first file of `run_dir` that a resume cannot use."""
    _check_meta(run_dir / schema.META_FILE)
    for table in schema.TABLES:
        for p in part_files(run_dir, table):
            _check_part(p)


def _check_meta(p: Path) -> None:
    if not p.is_file():
        return  # a fresh meta.json is written
    try:
        meta = json.loads(p.read_bytes())
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"--resume: {p} is unreadable ({_short(e)}); fix or remove it, then resume"
        ) from None
    if not isinstance(meta, dict):
        raise ConfigError(f"--resume: {p} is not a JSON object; fix or remove it, then resume")
    restarts = meta.get("restarts", 0)
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
        raise ConfigError(
            f"--resume: {p}: 'restarts' = {str(restarts)[:40]!r} is not a count; fix it, then resume"
        )


def _check_part(p: Path) -> None:
    try:
        cols = pl.read_parquet_schema(p)
    except Exception as e:  # polars raises its own types for truncated, empty or garbage files
        raise ConfigError(
            f"--resume: run store part {p} is damaged ({_short(e)}); move it out of the run folder "
            "(the other parts are intact) and resume again"
        ) from None
    step = cols.get("step")
    if step is None or not step.is_integer():
        raise ConfigError(
            f"--resume: run store part {p} has no integer 'step' column (found {step}); it was not written "
            "by moeguard: move it out of the run folder and resume again"
        )


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
