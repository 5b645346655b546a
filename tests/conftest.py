"""Shared fixtures: a micro training config and a helper that trains it in-process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
MICRO = REPO / "tests" / "data" / "micro.toml"


@pytest.fixture
def micro_config_path() -> Path:
    return MICRO


def train_micro(
    run_dir: Path,
    *,
    overrides: dict[str, Any] | None = None,
    injections: list[str] = (),
    resume: bool = False,
    guard_mode: str | None = None,
    until: int | None = None,
) -> Any:
    """Train the micro config in this process; returns the Trainer after run()."""
    from trainer.config import load_config
    from trainer.inject import parse_injection
    from trainer.loop import Trainer

    cfg = load_config(MICRO, overrides or {})
    if guard_mode:
        cfg.guard.mode = guard_mode
    t = Trainer(
        cfg, run_dir, resume=resume, injections=[parse_injection(s) for s in injections], progress=False
    )
    t.exit_code = t.run(until=until)
    return t
