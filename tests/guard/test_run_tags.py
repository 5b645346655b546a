"""meta.json "tags" from every entry point (issue #40): `moeguard train --tag` and the config's
`tags`, GuardedStep(tags=...), MoEGuardCallback(tags=...) and the torchtitan launcher's --tag."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from guard.api import GuardedStep
from guard.core import schema
from guard.core.tomlconf import ConfigError
from guard.store.reader import read_meta
from tests.conftest import MICRO


def _args(*extra: str) -> argparse.Namespace:
    from trainer.cli import configure

    p = argparse.ArgumentParser()
    configure(p)
    return p.parse_args(["--config", str(MICRO), *extra])


def test_train_tags_from_the_config_and_the_cli(tmp_path: Path) -> None:
    from tests.conftest import train_micro
    from trainer.cli import build_config

    cfg = build_config(
        _args("--set", 'tags=["sweep"]', "--tag", "h100", "--tag", "sweep", "--tag", "lr-3e-3")
    )
    assert cfg.tags == ["sweep", "h100", "lr-3e-3"]
    with pytest.raises(ConfigError, match="--tag"):
        build_config(_args("--tag", " "))
    with pytest.raises(ConfigError, match="tags"):
        build_config(_args("--set", "tags=[1]"))
    t = train_micro(tmp_path / "run", overrides={"train.steps": 2, "tags": ["a", "b"]})
    assert t.exit_code == 0
    assert read_meta(tmp_path / "run")[schema.META_TAGS] == ["a", "b"]


def test_guarded_step_tags(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with GuardedStep(model, opt, run_dir=tmp_path / "own", tags=["own-loop", "cpu", "cpu"]) as g:
        loss = model(torch.randn(2, 4)).pow(2).mean()
        loss.backward()
        g.step(loss, tokens=2)
    assert read_meta(tmp_path / "own")[schema.META_TAGS] == ["own-loop", "cpu"]
    model2 = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="tags"):
        GuardedStep(model2, torch.optim.SGD(model2.parameters(), lr=1e-2), tags=[""])


def test_a_run_without_tags_says_so(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    with GuardedStep(model, torch.optim.SGD(model.parameters(), lr=1e-2), run_dir=tmp_path / "r"):
        pass
    assert read_meta(tmp_path / "r")[schema.META_TAGS] == []


def test_torchtitan_launcher_takes_tags() -> None:
    pytest.importorskip("torchtitan")
    from guard.integrations.torchtitan.__main__ import main, parser

    args, rest = parser().parse_known_args(["--tag", "tt", "--tag", "fsdp", "--training.steps", "2"])
    assert args.tag == ["tt", "fsdp"] and rest == ["--training.steps", "2"]
    assert main(["--tag", " ", "--training.steps", "2"]) == 2  # refused before torchtitan starts


def test_callback_passes_tags_to_its_guarded_step() -> None:
    pytest.importorskip("transformers")
    from guard.integrations.hf_trainer import MoEGuardCallback

    cb = MoEGuardCallback(run_dir="x", tags=["hf"])
    assert cb.extra["tags"] == ["hf"]  # handed to GuardedStep(**extra) at train start
