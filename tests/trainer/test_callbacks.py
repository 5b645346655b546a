"""The trainer's hooks (trainer/callbacks/callback.py): called in step order, able to change what
they are handed, and their state kept in the checkpoint so a resumed run continues it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from guard.core import schema
from guard.core.events import Event
from guard.core.report import StepReport
from tests.conftest import MICRO
from trainer.callbacks.callback import Callback, Callbacks


class Recorder(Callback):
    name = "recorder"

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.steps_seen = 0  # kept across a resume through state_dict

    def pre_train(self) -> None:
        self.calls.append("pre_train")

    def pre_step(self, step: int) -> None:
        self.calls.append(f"pre_step {step}")

    def pre_load_batch(self, step: int) -> None:
        self.calls.append("pre_load_batch")

    def post_load_batch(self, step: int, batches: list[torch.Tensor]) -> None:
        self.calls.append("post_load_batch")

    def post_backward(self, step: int) -> None:
        self.calls.append("post_backward")

    def adjust_lr(self, step: int, lr: float) -> float:
        self.calls.append("adjust_lr")
        return lr

    def pre_record(self, step: int, events: list[Event]) -> None:
        self.calls.append("pre_record")

    def post_step(self, step: int, report: StepReport) -> None:
        self.calls.append(f"post_step {report.step}")
        self.steps_seen += 1

    def close(self) -> None:
        self.calls.append("close")

    def meta(self) -> dict[str, Any]:
        return {"recorder": True}

    def state_dict(self) -> dict[str, Any]:
        return {"steps_seen": self.steps_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps_seen = int(state.get("steps_seen", 0))


def trainer(run_dir: Path, callbacks: list[Callback], *, resume: bool = False, **overrides: Any) -> Any:
    from trainer.config import load_config
    from trainer.loop import Trainer

    cfg = load_config(MICRO, {"train.steps": 6, "train.checkpoint_every": 3, **overrides})
    return Trainer(cfg, run_dir, resume=resume, progress=False, callbacks=callbacks)


def test_hooks_run_in_step_order_and_state_survives_a_resume(tmp_path: Path) -> None:
    from guard.store.reader import read_meta

    rec = Recorder()
    assert trainer(tmp_path, [rec]).run(until=3) == 0
    one_step = ["pre_load_batch", "post_load_batch", "post_backward", "adjust_lr", "pre_record"]
    assert rec.calls[:8] == ["pre_train", "pre_step 0", *one_step, "post_step 0"]
    assert rec.calls[-1] == "close" and rec.calls.count("close") == 1
    assert read_meta(tmp_path)["recorder"] is True  # meta() lands in meta.json
    again = Recorder()
    t = trainer(tmp_path, [again], resume=True)
    assert again.steps_seen == 3  # restored from the step-3 checkpoint
    t.run()
    assert again.steps_seen == 6 and again.calls[1] == "pre_step 3"


def test_the_plain_loop_calls_no_guarded_hooks(tmp_path: Path) -> None:
    rec = Recorder()
    trainer(tmp_path, [rec], **{"telemetry.enabled": False}).run(until=1)
    assert "adjust_lr" not in rec.calls and "pre_record" not in rec.calls
    assert ["pre_step 0", "pre_load_batch", "post_load_batch", "post_backward", "post_step 0"] == rec.calls[
        1:6
    ]


class Doubler(Callback):
    """Changes what it is handed: the LR the guard sees, and adds an event of its own."""

    name = "doubler"

    def adjust_lr(self, step: int, lr: float) -> float:
        return 2 * lr

    def pre_record(self, step: int, events: list[Event]) -> None:
        events.append(Event(step=step, kind=schema.EV_INJECT, detail={"injection": "test"}))


def test_a_callback_changes_the_lr_and_adds_events(tmp_path: Path) -> None:
    from guard.store.reader import read_table
    from trainer.loop import lr_at

    t = trainer(tmp_path, [Doubler()])
    rep = t.train_step()
    assert rep.lr == pytest.approx(2 * lr_at(0, t.cfg))
    t.store.close()
    events = read_table(tmp_path, schema.TABLE_EVENTS)
    assert events.filter(events["kind"] == schema.EV_INJECT)["step"].to_list() == [0]


def test_callback_names_are_unique() -> None:
    with pytest.raises(ValueError, match="unique"):
        Callbacks(object(), [Recorder(), Recorder()])  # type: ignore[arg-type]
