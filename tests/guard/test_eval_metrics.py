"""Evaluation metrics in the run store (issue #40): GuardedStep.log and MoEGuardCallback's
on_evaluate write the `evals` table (schema.EVALS_COLUMNS) at the last step taken."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from guard.api import GuardedStep
from guard.core import schema
from guard.store.reader import read_meta, read_table


def _loop(run: Path, steps: int, **kw) -> GuardedStep:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    g = GuardedStep(model, opt, run_dir=run, **kw)
    for _ in range(steps):
        loss = model(torch.randn(2, 4)).pow(2).mean()
        loss.backward()
        g.step(loss, tokens=2)
    return g


def test_guarded_step_log_writes_the_evals_table(tmp_path: Path) -> None:
    g = _loop(tmp_path / "r", 3)
    g.log(eval_loss=torch.tensor(1.25), eval_acc=0.5)  # after step 2 (0-based)
    with pytest.raises(TypeError, match="eval_loss"):
        g.log(eval_loss="low")  # type: ignore[arg-type]
    g.log(step=7, eval_loss=1.0)
    g.close()
    ev = read_table(tmp_path / "r", schema.TABLE_EVALS).sort("step", "name")
    assert ev.columns == list(schema.EVALS_COLUMNS)
    assert ev.select("step", "name", "value").rows() == [
        (2, "eval_acc", 0.5),
        (2, "eval_loss", 1.25),
        (7, "eval_loss", 1.0),
    ]
    assert (ev["time"] > 0).all()


def test_a_run_without_evaluations_has_an_empty_evals_table(tmp_path: Path) -> None:
    _loop(tmp_path / "r", 2).close()
    assert read_table(tmp_path / "r", schema.TABLE_EVALS).height == 0


@pytest.mark.slow
def test_trainer_evaluate_lands_in_the_run_store(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    from guard.integrations.hf_trainer import MoEGuardCallback
    from guard.integrations.tiny import build

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, n: int) -> None:
            self.x = torch.from_numpy(np.random.default_rng(0).integers(0, 256, size=(n, 16)))

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.x[i], "labels": self.x[i].clone()}

    torch.set_num_threads(1)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=4,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        eval_strategy="steps",
        eval_steps=2,
        learning_rate=1e-3,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    run = tmp_path / "out" / "moeguard"
    cb = MoEGuardCallback(run_dir=run, tags=["hf", "eval"])
    trainer = Trainer(
        model=build("mixtral", seed=0),
        args=args,
        train_dataset=Tokens(8),
        eval_dataset=Tokens(4),
        callbacks=[cb],
    )
    trainer.train()
    logged = [(r["step"], r["eval_loss"]) for r in trainer.state.log_history if "eval_loss" in r]
    ev = read_table(run, schema.TABLE_EVALS).filter(pl_name("eval_loss")).sort("step")
    # the Trainer's global_step N is the guard's step N - 1 (0-based)
    assert [(s + 1, pytest.approx(v)) for s, v in ev.select("step", "value").rows()] == logged
    assert len(logged) == 2
    assert read_meta(run)[schema.META_TAGS] == ["hf", "eval"]


def pl_name(name: str):
    import polars as pl

    return pl.col("name") == name
