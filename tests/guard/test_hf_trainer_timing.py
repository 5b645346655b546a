"""What MoEGuardCallback records of a transformers `Trainer` run's time and dtype (issue #40,
items 1, 6 and 7), on the real Trainer with a tiny Mixtral on the CPU.

- Step 0 is timed over the whole step, like every other (the GuardedStep is built at the first
  optimizer step; its clock used to start there, so step 0 held only the guard's own work and
  its tokens/s read 10-60x the run's median), and the run's wall time starts at train start (it
  left step 0 out: 743.7 s against the Trainer's 770 s).
- The Trainer's saves are goodput's checkpoint_s (they read 0.0 after 3 saves), and a resume
  books the gap since the checkpoint as restarts_s (it landed in other_s).
- bf16=True records "bf16-autocast" in meta.json's env (it read "float32"); a plain loop's
  forward under torch.autocast does too.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate: pip install accelerate")

from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from guard.core import schema  # noqa: E402
from guard.integrations.hf_resume import GUARD_STATE_FILE  # noqa: E402
from guard.integrations.hf_trainer import MoEGuardCallback  # noqa: E402
from guard.integrations.tiny import build  # noqa: E402
from guard.store.reader import read_meta, read_table  # noqa: E402

pytestmark = [pytest.mark.slow]
SEQ, BATCH = 32, 2
FIRST_FORWARD_S = 0.8  # step 0's forward: a compile or a cold cache, what a first step costs
FORWARD_S = 0.05


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.x = torch.from_numpy(np.random.default_rng(0).integers(0, 256, size=(n, SEQ)))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i].clone()}


class SlowForward:
    """A forward pre-hook standing in for a model whose forward dominates the step (as a real one
    does, where the tiny model's forward is ~1 ms): the first forward is the slowest."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        if module.training:
            time.sleep(FIRST_FORWARD_S if self.calls == 0 else FORWARD_S)
            self.calls += 1


def train(
    out: Path, *, steps: int, save_steps: int = 0, bf16: bool = False, resume: str | None = None
) -> Any:
    torch.set_num_threads(1)
    model = build("mixtral", seed=0)
    model.register_forward_pre_hook(SlowForward())
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        report_to="none",
        use_cpu=True,
        bf16=bf16,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    callbacks: list[TrainerCallback] = [MoEGuardCallback(run_dir=out / "moeguard")]
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(steps * BATCH), callbacks=callbacks)
    return trainer.train(resume_from_checkpoint=resume)


def test_step_0_is_timed_over_the_whole_step_and_the_wall_time_from_train_start(tmp_path: Path) -> None:
    out = train(tmp_path / "out", steps=8)
    run = tmp_path / "out" / "moeguard"
    steps = read_table(run, schema.TABLE_STEPS).sort("step")
    t = steps["step_time_s"].to_list()
    rate = steps["tokens_per_s"].to_list()
    assert t[0] >= FIRST_FORWARD_S, t  # the slow first forward is step 0's
    assert min(t[1:]) >= FORWARD_S, t
    median = float(np.median(rate[1:]))
    assert rate[0] <= 1.5 * median, (rate[0], median)  # not the chart's y-axis any more
    gp = read_meta(run)["goodput"]
    runtime = out.metrics["train_runtime"]
    assert gp["wall_s"] >= 0.97 * runtime, (gp["wall_s"], runtime)  # step 0 is in the wall time
    assert sum(t) <= gp["wall_s"] + 1e-6


def test_saves_are_checkpoint_time_and_a_resume_books_its_gap_as_restarts(tmp_path: Path) -> None:
    out = tmp_path / "out"
    train(out, steps=6, save_steps=2)  # checkpoint-2, -4 and -6
    run = out / "moeguard"
    first = read_meta(run)["goodput"]
    assert first["checkpoint_s"] > 0, first
    assert first["restarts_s"] == 0, first

    # checkpoint-4's guard state is written inside save 4, so it carries the saves before it
    carried = torch.load(out / "checkpoint-4" / GUARD_STATE_FILE, weights_only=False)["goodput"]["split"]
    assert 0 < carried["checkpoint_s"] < first["checkpoint_s"], (carried, first)

    time.sleep(1.5)  # the job is down this long after checkpoint-4
    train(out, steps=6, save_steps=2, resume=str(out / "checkpoint-4"))
    meta = read_meta(run)
    gp = meta["goodput"]
    assert meta["restarts"] == 1
    # at least the time down; steps 4 and 5 of the first attempt (redone) on top
    assert gp["restarts_s"] >= 1.5, gp
    assert gp["other_s"] < gp["restarts_s"], gp  # the gap no longer lands in other_s
    assert gp["checkpoint_s"] > carried["checkpoint_s"], (gp, carried)  # carried over, and save 6 anew


def test_bf16_is_recorded_as_the_dtype_the_step_computes_in(tmp_path: Path) -> None:
    train(tmp_path / "bf16", steps=2, bf16=True)
    assert read_meta(tmp_path / "bf16" / "moeguard")["env"]["dtype"] == "bf16-autocast"
    train(tmp_path / "fp32", steps=2)
    assert read_meta(tmp_path / "fp32" / "moeguard")["env"]["dtype"] == "float32"


def test_a_plain_loop_under_autocast_records_the_autocast_dtype(tmp_path: Path) -> None:
    from guard.api import GuardedStep

    for name, autocast in (("amp", True), ("plain", False)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        with GuardedStep(model, opt, run_dir=tmp_path / name) as g:
            for _ in range(2):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    loss = model(torch.randn(4, 8)).float().pow(2).mean()
                loss.backward()
                g.step(loss)
                opt.zero_grad()
        want = "bf16-autocast" if autocast else "float32"
        assert read_meta(tmp_path / name)["env"]["dtype"] == want
