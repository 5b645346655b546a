"""`moeguard canary`: guard's canary (guard/canary/) driven with this trainer.

guard/cli.py names this module for the `canary` command (a string, like `train` -> trainer.cli).
guard never imports trainer, so this is where the two meet: `TRAINER` hands guard the training
config's schema, the `--set` parser and the measuring worker (trainer/canary_worker.py).
"""

from __future__ import annotations

import argparse
from typing import Any

from guard.canary import cli
from guard.canary.config import TrainerSide
from guard.core.tomlconf import from_dict
from trainer.cli import parse_overrides


def build_train_config(data: dict[str, Any]) -> Any:
    """Raw TOML tables -> a validated TrainConfig (a ConfigError names the bad key)."""
    from trainer.config import TrainConfig  # imports the model (torch) only when a canary runs

    return from_dict(TrainConfig, data)


TRAINER = TrainerSide(
    build_config=build_train_config,
    parse_overrides=parse_overrides,
    worker=("-m", "trainer.canary_worker"),
)


def configure(p: argparse.ArgumentParser) -> None:
    cli.configure(p)


def run(args: argparse.Namespace) -> int:
    return cli.run(args, TRAINER)
