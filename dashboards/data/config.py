"""The app's settings: `streamlit run app.py -- --runs DIR ...`, else environment variables."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

ENV_RUNS = "MOEGUARD_APP_RUNS"


ENV_HISTORY = "MOEGUARD_APP_HISTORY"


ENV_COLLECTOR = "MOEGUARD_APP_COLLECTOR"


@dataclass(frozen=True, slots=True)
class AppConfig:
    runs_dir: Path
    history: Path | None = None
    collector: str | None = None


def app_config(argv: list[str] | None = None) -> AppConfig:
    """The app's settings from its command line (after `--`), falling back to env vars."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--runs")
    p.add_argument("--history")
    p.add_argument("--collector")
    args, _ = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    runs = args.runs or os.environ.get(ENV_RUNS) or "runs"
    history = args.history or os.environ.get(ENV_HISTORY) or None
    collector = args.collector or os.environ.get(ENV_COLLECTOR) or None
    return AppConfig(runs_dir=Path(runs), history=Path(history) if history else None, collector=collector)
