"""Shared fixtures: a micro training config and a helper that trains it in-process."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
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


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session: pytest.Session) -> Iterator[None]:
    """Collecting imports every test module's dependencies (torch, transformers, streamlit,
    polars): with CPython's cyclic GC on, 17 full collections that free nothing took ~8 CPU-s of
    the 26-30 of collecting the suite (gc.callbacks), paid by every xdist worker of every phase;
    with it off, 17.9 and 18.8 CPU-s against 30.3 and 25.7 (two runs each, side by side). Then
    one full collection (1.1-1.4 CPU-s), which leaves the collected heap in the oldest generation,
    so the next full one is as rare as before: CPython waits for that heap to grow by a quarter.
    Not `gc.freeze()`: with the collected heap out of that count, full collections during the
    tests came often (26 against none on tests/dashboards and two collector modules, 6.9 CPU-s)."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


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


def pytest_configure(config: pytest.Config) -> None:
    """scripts/test's pinned phase runs the A/B tests of moeguard's own canary worker two at a time,
    each xdist worker (and every process it starts: affinity is inherited) on a CPU of its own, so two
    A/B canaries never share a core (MOEGUARD_PIN_WORKERS=1; one torch thread each,
    OMP_NUM_THREADS=1). Not enough for the `unpaired` ones, which run alone afterwards."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if os.environ.get("MOEGUARD_PIN_WORKERS") == "1" and worker.startswith("gw"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[int(worker[2:]) % len(cpus)]})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """scripts/test's pinned serial phase: longest first (each `serial` test's cost=, its seconds on
    CI), so that its two workers end together. xdist hands a worker its next test while the worker
    still runs one, so a long test left to the end would run alone while the other CPU idles."""
    if os.environ.get("MOEGUARD_PIN_WORKERS") == "1":
        items.sort(key=lambda it: -_serial_cost(it))  # stable: equal costs keep their order
    wheel_runs = os.environ.get("MOEGUARD_WHEEL_RUNS", "").split()
    if wheel_runs:
        kept: list[pytest.Item] = []
        left_out: list[pytest.Item] = []
        for it in items:
            (left_out if runs_against_the_wheel(it, wheel_runs) else kept).append(it)
        if left_out:
            items[:] = kept
            config.hook.pytest_deselected(items=left_out)


def runs_against_the_wheel(item: pytest.Item, paths: list[str]) -> bool:
    """scripts/test's parallel phase leaves out what scripts/test-wheel runs beside it against the
    installed wheel ($MOEGUARD_WHEEL_RUNS: its test paths; their tests not marked `integration`):
    the same test files over the same source, run once, not twice."""
    module = item.nodeid.split("::", 1)[0]
    under = any(module == p or module.startswith(p.rstrip("/") + "/") for p in paths)
    return under and item.get_closest_marker("integration") is None


def _serial_cost(item: pytest.Item) -> float:
    marker = item.get_closest_marker("serial")
    return float(marker.kwargs.get("cost", 0)) if marker else 0.0


def pytest_deselected(items: list[pytest.Item]) -> None:
    """scripts/test's parallel phase (-m "not serial") names the `serial` tests it left out in
    $MOEGUARD_SERIAL_LIST, so the serial phase collects those modules alone, not the whole suite."""
    path = os.environ.get("MOEGUARD_SERIAL_LIST")
    if path:
        with open(path, "a") as f:
            f.writelines(f"{it.nodeid}\n" for it in items if it.get_closest_marker("serial"))
