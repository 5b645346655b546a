"""Issue #32's clock and validation attacks: trainers whose clocks run ahead or behind, and inputs
that must be refused at the edge (the collector's batch checks, `moeguard train`'s start).

Writes docs/BENCHMARKS.md: no section of its own; part of Collector › Collector and pager under
attack (issues #13 and #32, `bench/attacks/collector_attacks.py`).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from bench.attacks.kit import G1, REPO, CollectorProc, Ledger, Row, batch, report
from guard.core import schema

DAY = 86400.0


def _ranks(c: CollectorProc, run: str) -> dict[str, Any]:
    runs = c.get("/v1/runs").json()["runs"]
    return next((r.get("ranks") or {} for r in runs if r["run"] == run), {})


def _goodput(c: CollectorProc, run: str) -> float:
    for fam in text_string_to_metric_families(c.get("/metrics").text):
        for s in fam.samples:
            if s.name == schema.M_GOODPUT and s.labels.get("run") == run:
                return s.value
    return float("nan")


def skewed_clocks(work: Path) -> Row:
    """Trainer clocks off by an hour, a day and a month: a takeover by a clock ahead, goodput
    with one report stamped a month ahead, liveness after a collector restart."""
    c = CollectorProc(work, "--heartbeat-floor", "2").start()
    ledger, checks = Ledger(), {}
    try:
        good = int(time.time()) - 5
        ledger.post(c, batch("owned", good << 32 | 1, [0]))
        ahead = c.ingest(batch("owned", (int(time.time()) + 3600) << 32 | 1, [1])).status_code
        checks["takeover by a clock 1 h ahead refused (409)"] = ahead == 409
        checks["the correct trainer keeps the run"] = (
            ledger.post(c, batch("owned", good << 32 | 2, [1])).status_code == 200
        )
        reps = [report(s).to_json() for s in range(10)]
        now = time.time()
        for s, r in enumerate(reps):
            r["time"] = now - 10 + s
        reps[5]["time"] = now + 30 * DAY
        ledger.post(c, {"run": "gp", "rank": 0, "seq": G1 | 1, "reports": reps, "events": []})
        gp = _goodput(c, "gp")
        checks[f"goodput with a report a month ahead: {gp:.3f} (was 3.9e-07)"] = gp > 0.01
        for run, skew in (("dead-ahead", DAY), ("alive-behind", -DAY)):
            hb = {"time": time.time() + skew, "step": 0, "phase": "train"}
            ledger.post(c, batch(run, G1 | 1, [0], heartbeat=hb))
        c.kill()  # restart: the log replays those beats
        c.start()
        age = _ranks(c, "alive-behind").get("0", {}).get("age_s")
        checks["a clock a day behind: its age after the restart is seconds, not a day"] = (
            age is not None and age < 60
        )
        time.sleep(3.5)  # past the 2 s heartbeat floor
        checks["a dead rank a day ahead: lost after the timeout"] = (
            _ranks(c, "dead-ahead").get("0", {}).get("lost") is True
        )
        up = c.alive()
    finally:
        c.stop()
    lost, twice = ledger.check(c.runs)
    failed = [k for k, ok in checks.items() if not ok]
    return Row(
        attack="skewed_clocks",
        item="32.3",
        what="trainer clocks an hour / a day / a month off: takeover, goodput, liveness across a restart",
        answer=f"{sum(checks.values())}/{len(checks)} as designed"
        + (f"; not: {'; '.join(failed)}" if failed else "")
        + f"; {next(k for k in checks if k.startswith('goodput'))}",
        up=up,
        lost=lost,
        twice=twice,
        held=not failed and up,
    )


def _train(work: Path, *args: str) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "guard", "train", "--config", str(REPO / "tests/data/micro.toml")]
    cmd += ["--steps", "2", "--no-progress", *args]
    p = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=300)
    return p.returncode, p.stderr.strip()


def validation_edges(work: Path) -> Row:
    """Inputs that passed and should not: a count past Int64, steps going back, a run name that
    is no run id or escapes runs/, an infinite LR, a negative --until."""
    c = CollectorProc(work).start()
    ledger, checks = Ledger(), {}
    try:
        rep = report(0).to_json()
        rep["tokens"] = 2**63
        r = c.ingest({"run": "edge", "rank": 0, "seq": G1 | 1, "reports": [rep], "events": []})
        checks["tokens = 2**63: 400 naming it"] = r.status_code == 400 and "'tokens'" in r.text
        r = c.ingest(batch("edge", G1 | 2, [4, 4, 3]))
        checks["steps [4, 4, 3]: 400 naming step 3"] = r.status_code == 400 and "reports[2].step" in r.text
        checks["steps [4, 4, 5]: stored once each"] = (
            ledger.post(c, batch("edge", G1 | 3, [4, 4, 5])).status_code == 200
        )
        r = c.ingest(batch("edge", G1 | 4, [2, 1]))
        checks["then [2, 1]: 400 naming step 2"] = r.status_code == 400 and "reports[0].step: 2" in r.text
        up = c.alive()
    finally:
        c.stop()
    lost, twice = ledger.check(c.runs)
    stored = sorted(_steps(c.runs / "edge"))
    checks[f"stored steps {stored}"] = stored == [4, 5]
    work.mkdir(parents=True, exist_ok=True)
    for args, what in (
        (("--set", 'name="../outside"', "--steps", "2"), "name '../outside'"),
        (("--run-dir", "runs/my run"), "run folder 'my run'"),
        (("--set", "optim.lr=inf"), "optim.lr = inf"),
        (("--until", "-1"), "--until -1"),
    ):
        rc, err = _train(work, *args)
        checks[f"train {what}: exit 2, one line"] = rc == 2 and len(err.splitlines()) == 1
    checks["nothing written outside runs/"] = (
        not (work / "outside").exists() and not (work.parent / "outside").exists()
    )
    failed = [k for k, ok in checks.items() if not ok]
    return Row(
        attack="validation_edges",
        item="32.4",
        what="Int64 overflow, steps going back, bad run names, lr = inf, --until -1",
        answer=f"{sum(checks.values())}/{len(checks)} refused or stored as designed"
        + (f"; not: {'; '.join(failed)}" if failed else ""),
        up=up,
        lost=lost,
        twice=twice,
        held=not failed and up,
    )


def _steps(run_dir: Path) -> list[int]:
    from guard.store.reader import read_table

    return read_table(run_dir, schema.TABLE_STEPS)["step"].to_list()
