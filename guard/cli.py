"""`moeguard <command>`: a thin dispatcher.

Each command lives in its own module exposing `configure(parser)` and `run(args) -> int`.
Only the chosen command's module is imported, so `moeguard collector` starts without torch.
Paging is Alertmanager's (alerts/alertmanager.yml); `moeguard pager` was retired (docs/NOTES.md).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from guard.core.tomlconf import ConfigError
from guard.extras import MissingExtra, require
from guard.store.full import EXIT_DISK_FULL, disk_full_line

# name -> (module, one-line help). Order is the order --help lists them.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("trainer.cli", "train an MoE model with the stability guard on (telemetry to the run store)"),
    "demo": (
        "trainer.demo",
        "fault drill: same seed clean / faulty-unguarded / faulty-guarded, side by side",
    ),
    "replay": (
        "guard.replay",
        "run the detectors and policy over a recorded run and print what they would do",
    ),
    "collector": (
        "guard.collector.main",
        "HTTP service: ingest telemetry, server-side detectors, /metrics",
    ),
    "app": ("dashboards.launch", "start the Streamlit run-health app over a run store"),
    # The canary's gate, history and reports are guard/canary/; the worker that runs the model is the
    # trainer's, so the command enters through trainer/canary_cli.py (guard never imports trainer).
    "canary": (
        "trainer.canary_cli",
        "MFU/throughput regression canary against a recorded history (CI gate)",
    ),
    "grafana": ("dashboards.grafana.cli", "push moeguard's Grafana dashboards with grafana-client"),
}
# command -> the extra it needs beyond the core install (guard/extras.py)
COMMAND_EXTRAS = {"collector": "collector", "app": "app", "grafana": "grafana"}


def version() -> str:
    """The installed distribution's version ('unknown' when run from a checkout not installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("moeguard")
    except PackageNotFoundError:
        return "unknown"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moeguard",
        description="moeguard: watch every step of MoE training, fix what can be fixed in-job, "
        "page a human for the rest, and chart run health.",
    )
    parser.add_argument("--version", action="version", version=f"moeguard {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            importlib.import_module(module).configure(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    if command is not None and command not in COMMANDS:
        print(f"moeguard: unknown command {command!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        if command in COMMAND_EXTRAS:
            require(COMMAND_EXTRAS[command], f"moeguard {command}")
        parser = build_parser(command)
    except MissingExtra as e:
        print(e, file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except ConfigError as e:
        print(f"moeguard {args.command}: config error: {e}", file=sys.stderr)
        return 2
    except MissingExtra as e:  # e.g. telemetry.otlp_endpoint without the otel extra
        print(f"moeguard {args.command}: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `moeguard replay ... | head`
        return 0
    except KeyboardInterrupt:
        print(f"moeguard {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a full disk is one line (guard/store/full.py), anything else a traceback
        line = disk_full_line(e)
        if line is None:
            raise
        print(f"moeguard {args.command}: {line}", file=sys.stderr)
        return EXIT_DISK_FULL
