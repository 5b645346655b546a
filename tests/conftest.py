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


def _defines_module_fixture(module: str, _seen: dict[str, bool] = {}) -> bool:  # noqa: B006 (a cache)
    if module not in _seen:
        path = REPO / module
        _seen[module] = path.is_file() and 'scope="module"' in path.read_text()
    return _seen[module]


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """scripts/test's parallel phase (pytest-xdist, `-n N`): hand tests out one by one, except that a
    module defining a module-scoped fixture (a trained run, a started server) goes whole to one
    worker, so the fixture is built once; those modules, the heavy ones, are handed out first.
    (xdist's own --dist loadgroup does not group under pytest 9: it renames node ids, which pytest 9
    no longer lets a plugin do.)"""
    if config.getvalue("dist") != "load":
        return None  # an explicit --dist other than the default: xdist's own scheduler
    from xdist.scheduler import LoadScopeScheduling

    class ModuleFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if _defines_module_fixture(module) else nodeid

    return ModuleFixtureScheduling(config, log)
