"""Inputs `moeguard train` must refuse at the start, in one line with exit 2 and nothing written
(issue #32, item 4): run names that are not run ids or not path-safe, a non-finite LR, a negative
--until, a model past the machine's memory.

Each case runs the real CLI (`python -m guard train`) on the micro config in a subprocess.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import polars as pl
import pytest

from tests.conftest import MICRO, train_micro
from tests.trainer.test_cli import one_line_error, train
from trainer.config import load_config
from trainer.memcheck import check_model_fits, total_params
from trainer.model import MoETransformer

CASES = {
    "dotdot-name": (("--set", 'name="../outside"'), "'../outside'"),
    "space-name": (("--set", 'name="my run"'), "'my run'"),
    "slash-name": (("--set", 'name="a/b"'), "'a/b'"),
    "inf-lr": (("--set", "optim.lr=inf"), "optim.lr = inf"),
    "nan-lr": (("--set", "optim.lr=nan"), "optim.lr = nan"),
    "until-negative": (("--until", "-1"), "--until -1"),
    "huge-model": (
        ("--set", "model.d_model=65536", "--set", "model.n_heads=64", "--set", "model.n_experts=256"),
        "GiB",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_start_is_one_line_exit_2_and_writes_nothing(tmp_path: Path, case: str) -> None:
    args, named = CASES[case]
    run = tmp_path / "r"
    line = one_line_error(train(run, "--steps", "2", "--no-progress", *args))
    assert named in line, line
    assert not run.exists() and not (tmp_path / "outside").exists()


def test_a_run_folder_whose_name_is_not_a_run_id_is_refused_at_start(tmp_path: Path) -> None:
    run = tmp_path / "my run"
    line = one_line_error(train(run, "--steps", "2", "--no-progress"))
    assert "'my run'" in line and "not a valid run id" in line
    assert not run.exists()


def test_the_memory_check_counts_every_parameter_of_the_real_model() -> None:
    cfg = load_config(MICRO)
    real = sum(p.numel() for p in MoETransformer(cfg.model).parameters())
    assert 0.95 * real <= total_params(cfg.model) <= real  # norms are left out
    check_model_fits(cfg, "cpu")  # the micro model fits anywhere


# ---------------------------------------------------------------------------------------
# --resume on a damaged run store (issue #32, item 5): one line naming the file, never a traceback
# ---------------------------------------------------------------------------------------
def _damage(run: Path, kind: str) -> str:
    """Damage `run`; returns the name the refusal must give."""
    part = sorted((run / "steps").glob("part-*.parquet"))[0]
    if kind == "truncated":
        part.write_bytes(part.read_bytes()[:300])
    elif kind == "garbage":
        part.write_bytes(b"not parquet at all")
    elif kind == "empty":
        part.write_bytes(b"")
    elif kind == "schema-drift":
        pl.DataFrame({"step": ["a", "b"], "loss": [1.0, 2.0]}).write_parquet(part)
    elif kind == "meta-types":
        meta = json.loads((run / "meta.json").read_text())
        (run / "meta.json").write_text(json.dumps({**meta, "restarts": "two"}))
        return "meta.json"
    elif kind == "checkpoint":
        ckpt = sorted((run / "checkpoints").iterdir())[-1]
        for f in ckpt.iterdir():
            if f.suffix == ".distcp":
                f.write_bytes(b"junk")
        return ckpt.name
    return part.name


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 3-step run, trained in this process (what is under test is the CLI's resume of it)."""
    run = tmp_path_factory.mktemp("resume") / "r"
    assert train_micro(run, overrides={"train.steps": 3, "train.threads": 1}).exit_code == 0
    return run


@pytest.mark.parametrize(
    "kind", ["truncated", "garbage", "empty", "schema-drift", "meta-types", "checkpoint"]
)
def test_resume_on_a_damaged_store_is_one_line_naming_the_file(
    trained: Path, tmp_path: Path, kind: str
) -> None:
    run = tmp_path / "r"
    shutil.copytree(trained, run)
    named = _damage(run, kind)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    line = one_line_error(train(run, "--steps", "5", "--resume", "--no-progress"))
    assert named in line and "--resume" in line, line
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before  # nothing changed
