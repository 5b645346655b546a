"""The app's settings: `streamlit run app.py -- --runs DIR ...`, else environment variables."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from guard.canary.ab_format import REPORT_DIR

ENV_RUNS = "MOEGUARD_APP_RUNS"


ENV_HISTORY = "MOEGUARD_APP_HISTORY"


ENV_COLLECTOR = "MOEGUARD_APP_COLLECTOR"


ENV_AB_REPORTS = "MOEGUARD_APP_AB_REPORTS"


@dataclass(frozen=True, slots=True)
class AppConfig:
    runs_dir: Path
    history: Path | None = None
    collector: str | None = None
    # A/B canary reports: an ab.json, or a folder of them (default: the run store's canary-report/,
    # where `moeguard canary --ab --runs DIR` writes)
    ab_reports: Path | None = None


def app_config(argv: list[str] | None = None) -> AppConfig:
    """The app's settings from its command line (after `--`), falling back to env vars."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--runs")
    p.add_argument("--history")
    p.add_argument("--collector")
    p.add_argument("--ab-reports")
    args, _ = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    runs = args.runs or os.environ.get(ENV_RUNS) or "runs"
    history = args.history or os.environ.get(ENV_HISTORY) or None
    collector = args.collector or os.environ.get(ENV_COLLECTOR) or None
    ab = args.ab_reports or os.environ.get(ENV_AB_REPORTS) or str(Path(runs) / REPORT_DIR)
    return AppConfig(
        runs_dir=Path(runs),
        history=Path(history) if history else None,
        collector=collector,
        ab_reports=Path(ab),
    )
