"""The trainer's cyclic GC at step boundaries (`train.gc_every`, trainer/step_gc.py): during the
run no automatic collection, the young generations every gc_every steps, everything at each
periodic checkpoint; the process's GC put back as it was when the run ends; 0 leaves CPython's
automatic GC alone; a negative value is refused by name."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest

from guard.core.tomlconf import ConfigError
from tests.conftest import MICRO, train_micro
from trainer.callbacks.callback import Callback
from trainer.config import load_config
from trainer.loop import Trainer


class Collections(Callback):
    """Every collection the GC runs while the run's steps do, with the trainer's step count then,
    and whether the automatic GC was on at each step's end."""

    name = "gc_collections"

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []  # (generation, the trainer's step count)
        self.enabled_at_steps: list[bool] = []
        self.watching = False

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start" and self.watching:
            self.seen.append((info["generation"], self.trainer.step))

    def pre_train(self) -> None:
        self.watching = True
        gc.callbacks.append(self._on_gc)

    def post_step(self, step: int, report: Any) -> None:
        self.enabled_at_steps.append(gc.isenabled())

    def close(self) -> None:
        self.watching = False
        gc.callbacks.remove(self._on_gc)


def _run(tmp_path: Path, **overrides: Any) -> tuple[Trainer, Collections]:
    cfg = load_config(MICRO, {"train.steps": 12, "telemetry.profile": False, **overrides})
    seen = Collections()
    t = Trainer(cfg, tmp_path / "run", progress=False, callbacks=[seen])
    assert t.run() == 0
    return t, seen


def test_collections_come_at_step_boundaries_and_the_gc_is_put_back(tmp_path: Path) -> None:
    assert gc.isenabled() and gc.get_freeze_count() == 0
    t, seen = _run(tmp_path, **{"train.gc_every": 4, "train.checkpoint_every": 6})
    assert seen.enabled_at_steps == [False] * 12  # no automatic collection during the run
    # generation 1 after steps 4, 8 and 12, a full collection after the periodic checkpoint at 6;
    # nothing else (the run's end puts the automatic GC back before the callbacks close: the
    # collections after step 12's are its own)
    assert [(g, s) for g, s in seen.seen if s < 12] == [(1, 4), (2, 6), (1, 8)], seen.seen
    assert seen.seen[3] == (1, 12), seen.seen
    assert gc.isenabled() and gc.get_freeze_count() == 0  # put back as it was
    assert t.step == 12


def test_a_run_started_with_the_gc_off_leaves_it_off(tmp_path: Path) -> None:
    gc.disable()
    try:
        _run(tmp_path, **{"train.gc_every": 4})
        assert not gc.isenabled() and gc.get_freeze_count() == 0
    finally:
        gc.enable()


def test_zero_leaves_cpythons_automatic_gc_alone(tmp_path: Path) -> None:
    _, seen = _run(tmp_path, **{"train.gc_every": 0})
    assert seen.enabled_at_steps == [True] * 12
    # a micro step allocates thousands of objects: generation 0 collects on its own, as always
    assert any(g == 0 for g, _ in seen.seen), seen.seen


def test_a_negative_gc_every_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"train\.gc_every.*-1"):
        train_micro(tmp_path / "run", overrides={"train.gc_every": -1})
