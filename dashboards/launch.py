"""`moeguard app`: start the Streamlit run-health app over a run store.

    moeguard app --runs DIR [--port 8501] [--host 127.0.0.1] [--history FILE] [--collector URL]
                 [--ab-reports PATH]

Runs `streamlit run dashboards/app.py --server.headless true ... -- --runs DIR ...` as a child
process (the app reads everything after `--`) and returns its exit code. The child goes down with this
process: SIGTERM, SIGINT and SIGHUP are passed on to it (and it is killed if it has not stopped
10 s later), and on Linux it is told to stop when its parent dies (PR_SET_PDEATHSIG), so even a
SIGKILL of `moeguard app` frees the port.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

from guard.core import schema

APP = Path(__file__).resolve().parent / "app.py"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--runs", required=True, metavar="DIR", help="run store: one folder per run (runs/<run_id>/)"
    )
    parser.add_argument("--port", type=int, default=8501, help="port to serve on (default 8501)")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for all)"
    )
    parser.add_argument("--history", metavar="FILE", help="canary history (JSONL) for the Canaries page")
    parser.add_argument("--collector", metavar="URL", help="collector or Alertmanager URL for open alerts")
    parser.add_argument(
        "--ab-reports",
        metavar="PATH",
        help="A/B canary reports for the Canaries page: an ab.json or a folder of them "
        "(default: RUNS/canary-report, where `moeguard canary --ab --runs RUNS` writes)",
    )


def streamlit_command(args: argparse.Namespace) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(APP),
        "--server.headless",
        "true",
        "--server.port",
        str(args.port),
        "--server.address",
        args.host,
        "--browser.gatherUsageStats",
        "false",
        "--",
        "--runs",
        str(Path(args.runs).resolve()),
    ]
    if args.history:
        cmd += ["--history", str(Path(args.history).resolve())]
    if args.collector:
        cmd += ["--collector", args.collector]
    if getattr(args, "ab_reports", None):
        cmd += ["--ab-reports", str(Path(args.ab_reports).resolve())]
    return cmd


def store_of(runs: Path, url: str) -> tuple[Path, str | None]:
    """(the run store to serve, a note) for `--runs`: a run folder (it has meta.json) is served
    through its parent, the store that holds it, and the note gives its health page's URL."""
    if not (runs / schema.META_FILE).is_file():
        return runs, None
    store = runs.resolve().parent
    return store, (
        f"{str(runs)!r} is a run (it has {schema.META_FILE}), not a folder of runs; serving its parent "
        f"{str(store)!r}: the run's page is {url}/health?run={runs.resolve().name}"
    )


def run(args: argparse.Namespace) -> int:
    runs, note = store_of(Path(args.runs), f"http://{args.host}:{args.port}")
    if note:
        print(f"moeguard app: note: {note}", file=sys.stderr)
        args.runs = str(runs)
    if not runs.is_dir():
        what = "is not a folder" if runs.exists() else "does not exist"
        print(
            f"moeguard app: run folder {str(runs)!r} {what}; pass --runs DIR where DIR holds "
            "one folder per run (the trainer's --run-dir parent)",
            file=sys.stderr,
        )
        return 2
    if args.history and not Path(args.history).is_file():
        print(
            f"moeguard app: note: canary history {args.history!r} does not exist yet; the Canaries page "
            "will say so until `moeguard canary --record` writes it",
            file=sys.stderr,
        )
    if not 0 < args.port < 65536:
        print(f"moeguard app: --port {args.port} is not a valid port", file=sys.stderr)
        return 2
    cmd = streamlit_command(args)
    print(f"moeguard app: serving {runs} on http://{args.host}:{args.port}", file=sys.stderr)
    return serve(cmd)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
CHILD_GRACE_S = 10.0  # after a passed-on signal, then SIGKILL


def _die_with(parent: int) -> None:
    """In the child, before exec: SIGTERM when `parent` dies (Linux), even by SIGKILL."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM))
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(0)


def serve(cmd: list[str]) -> int:
    """Run the Streamlit child until it exits; a stop signal to this process stops it too.
    Returns the child's exit code, or 128 + the signal that stopped this process."""
    parent = os.getpid()
    child = subprocess.Popen(
        cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=lambda: _die_with(parent)
    )
    got: list[int] = []

    def pass_on(signum: int, frame: object) -> None:
        del frame
        got.append(signum)
        if child.poll() is None:
            child.send_signal(signum)

    old = {sig: signal.signal(sig, pass_on) for sig in STOP_SIGNALS}
    try:
        while True:
            try:
                code = child.wait(timeout=CHILD_GRACE_S if got else None)
                break
            except subprocess.TimeoutExpired:
                child.kill()  # it ignored the signal: the port must not stay taken
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        if child.poll() is None:
            child.kill()
            child.wait()
    return 128 + got[0] if got else code
