"""Every playbook command that talks to the collector runs, as written, against a live one.

The shell commands come from the playbooks' fenced code blocks (and inline `curl ...` spans) that
use $MOEGUARD_COLLECTOR. A real collector on loopback holds a real run that the guard halted
(the trainer streamed it there) and a run whose rank 0 keeps beating without advancing (stuck,
for RunStuck's commands); each command runs in bash with MOEGUARD_COLLECTOR and
MOEGUARD_TOKEN set and `<run_id>` filled in, and must exit 0 and print something that is not an
error. Needs curl and jq (scripts/test installs jq); skipped without them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from guard.core import schema
from tests.conftest import MICRO, REPO
from tests.helpers_collector import CollectorProc
from tests.helpers_http import http_json, wait_until

PLAYBOOKS = REPO / "playbooks"
TOKEN = "playbook-token"
RUN = "drill"
STUCK_RUN = "wedged"

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        shutil.which("jq") is None or shutil.which("curl") is None,
        reason="the playbooks' commands need curl and jq (scripts/test installs both)",
    ),
]


def collector_commands() -> list[tuple[str, str]]:
    """(playbook, command) for every shell command in a playbook that calls the collector."""
    out = []
    for md in sorted(PLAYBOOKS.glob("*.md")):
        lines, in_block, lang = [], False, ""
        for raw in md.read_text().splitlines():
            line = raw.strip()
            if line.startswith("```"):
                in_block, lang = not in_block, line[3:].strip()
                continue
            if in_block and lang in ("bash", "sh", "shell", ""):
                lines.append(line)
            elif not in_block:  # inline spans: `curl -s $MOEGUARD_COLLECTOR/...`
                out += [(md.name, c) for c in re.findall(r"`(curl [^`]*\$MOEGUARD_COLLECTOR[^`]*)`", raw)]
        for cmd in _join(lines):
            if "$MOEGUARD_COLLECTOR" in cmd or "${MOEGUARD_COLLECTOR}" in cmd:
                out.append((md.name, cmd))
    return out


def _join(lines: list[str]) -> list[str]:
    """Shell lines with backslash continuations joined."""
    cmds, cur = [], ""
    for line in lines:
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        cmds.append(cur + line)
        cur = ""
    return cmds


COMMANDS = collector_commands()


def test_the_playbooks_have_collector_commands_to_check() -> None:
    books = {book for book, _ in COMMANDS}
    assert {
        "RunHalted.md",
        "HeartbeatLost.md",
        "GuardRollbackStorm.md",
        "README.md",
        "Watchdog.md",
        "RunStuck.md",
        "RunQuarantined.md",
    } <= books, books


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A collector on loopback, holding run `drill` that the guard halted while streaming to it."""
    tmp = tmp_path_factory.mktemp("playbooks")
    env = {**os.environ, schema.ENV_TOKEN: TOKEN}
    env.pop(schema.ENV_COLLECTOR, None)
    collector = CollectorProc(
        tmp / "collector-runs", "--progress-floor", "1", token=TOKEN, stderr=tmp / "collector.log"
    ).start()
    url = collector.url
    try:
        # two rollbacks' worth of NaN steps with halt_after_rollbacks = 1: the guard halts at step 22
        nans = [a for s in (12, 13, 14, 20, 21, 22) for a in ("--inject", f"nan@{s}")]
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "guard",
                "train",
                "--config",
                str(MICRO),
                "--run-dir",
                str(tmp / "train" / RUN),
                "--steps",
                "30",
                "--no-progress",
                "--collector",
                url,
                "--set",
                "train.threads=1",
                "--set",
                "guard.policy.snapshot_every=5",
                "--set",
                "guard.policy.halt_after_rollbacks=1",
                *nans,
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert p.returncode == 3, p.stderr[-3000:]

        def halted() -> bool:
            _, body = http_json(f"{url}/v1/runs")
            return any(r["run"] == RUN and r["status"] == schema.STATUS_HALTED for r in body["runs"])

        wait_until(halted, timeout=30, what=f"run {RUN} halted at the collector")
        make_stuck_run(url)
        yield {**env, schema.ENV_COLLECTOR: url}
    finally:
        collector.stop()


def make_stuck_run(url: str) -> None:
    """Run `wedged`: rank 0 makes four 10 ms steps (a 1 s deadline, the floor), then keeps beating
    at step 3 until the collector calls it stuck."""
    gen, auth = int(time.time()), {"Authorization": f"Bearer {TOKEN}"}
    t0 = time.time()

    def beat(i: int, step: int, sent: float) -> None:
        body = {
            "run": STUCK_RUN,
            "rank": 0,
            "seq": gen << 32 | i,
            "heartbeat": {"time": sent, "step": step, "phase": "train"},
        }
        status, answer = http_json(f"{url}/v1/ingest", body, headers=auth)
        assert status == 200, answer

    for i in range(5):
        beat(i, max(0, i - 1), t0 + 0.01 * i)
    n = 5

    def stuck() -> bool:
        nonlocal n
        beat(n, 3, time.time())
        n += 1
        _, body = http_json(f"{url}/v1/runs")
        return any(r["run"] == STUCK_RUN and r["ranks"].get("0", {}).get("stuck") for r in body["runs"])

    wait_until(stuck, timeout=30, interval=0.2, what=f"run {STUCK_RUN} rank 0 stuck at the collector")


def json_values(text: str) -> list[Any]:
    """The JSON values jq (or the collector) printed, one after another."""
    dec, i, out = json.JSONDecoder(), 0, []
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        v, i = dec.raw_decode(text, i)
        out.append(v)
    return out


@pytest.mark.parametrize(("book", "command"), COMMANDS, ids=[f"{b}:{c[:60]}" for b, c in COMMANDS])
def test_playbook_command_runs_against_a_live_collector(
    live: dict[str, str], book: str, command: str
) -> None:
    cmd = command.replace("<run_id>", RUN)
    assert not re.search(r"<[a-z_ ]+>", cmd), f"{book}: a placeholder the reader must fill in: {cmd}"
    p = subprocess.run(
        ["bash", "-o", "pipefail", "-c", cmd], env=live, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, f"{book}: {cmd}\n{p.stderr}"
    assert p.stdout.strip(), f"{book}: no output from {cmd}\n{p.stderr}"
    values = json_values(p.stdout)  # every answer and every jq filter here prints JSON
    assert values and not any(isinstance(v, dict) and "error" in v for v in values), p.stdout
    if "select(.value.stuck)" in cmd:  # RunStuck: the stuck rank, its phase and how long
        stuck = {v["run"]: v["stuck"] for v in values[0]}
        assert [(s["rank"], s["phase"], s["last_step"]) for s in stuck[STUCK_RUN]] == [("0", "train", 3)], (
            stuck
        )
        assert stuck[STUCK_RUN][0]["progress_age_s"] > stuck[STUCK_RUN][0]["progress_deadline_s"]
        assert stuck[RUN] == []
    if "select(.run ==" in cmd:  # the run the alert names, with what the playbook reads from it
        assert all(v.get("status") == schema.STATUS_HALTED for v in values), p.stdout
        assert all(isinstance(v.get("last_step"), int) for v in values), p.stdout
