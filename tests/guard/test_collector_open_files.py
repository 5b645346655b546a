"""The open-files limit at the collector's start-up, sized from the ranks it serves (issue #30):
raised to what --rank-capacity needs, or, under a hard limit too low, one WARNING line naming the
limit, its value and the ranks it covers; and under that low limit, more idle connections than
the process may open neither crash it nor flood its log, and a batch is answered 200 after them.

Each test runs a real collector process whose limit is set in the child before it starts.
"""

from __future__ import annotations

import resource
import time
from pathlib import Path

import httpx
import pytest

from guard.wire.open_files import files_needed, plan_open_files
from tests.guard.test_collector_flood import G1, STACKS, _body, collector_under, idle_sockets
from tests.helpers_collector import AUTH, make_report


def _soft_nofile(pid: int) -> tuple[str, str]:
    """(soft, hard) of 'Max open files' in /proc/PID/limits."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return soft, hard
    raise AssertionError("no 'Max open files' line")


@pytest.mark.integration
def test_start_up_raises_the_soft_limit_to_what_the_ranks_need(tmp_path: Path) -> None:
    """Soft 1,024 under a hard 4,096: 1,000 ranks and 100 runs in memory need 2,353 files; the soft
    limit becomes exactly that (not the hard limit), connections are capped at 2 x 1,000 with 1,000
    kept for authenticated ranks, and nothing is warned."""
    log = tmp_path / "collector.log"
    need = files_needed(1000, 100)
    assert need == 2 * 1000 + 100 + 128 + 125
    flags = ("--rank-capacity", "1000", "--max-hot-runs", "100")
    with collector_under(tmp_path, *flags, log=log, nofile=(1024, 4096)) as c:
        assert c.proc is not None
        assert _soft_nofile(c.proc.pid) == (str(need), "4096")
        conns = httpx.get(f"{c.url}/healthz", timeout=5).json()["connections"]
        assert conns["cap"] == 2000 and conns["ranks_covered"] == 1000 and conns["ranks_wanted"] == 1000
    text = log.read_text()
    assert f"soft limit {need} (raised from 1024; hard 4096" in text
    assert " WARNING " not in text


@pytest.mark.integration
def test_a_hard_limit_short_of_the_ranks_asked_is_one_warning_line_naming_it(tmp_path: Path) -> None:
    """Hard 1,024 and --rank-capacity 16,384 asked: the collector starts, says in one WARNING line
    the limit, its value and the ranks it covers, and serves."""
    log = tmp_path / "collector.log"
    with collector_under(tmp_path, "--rank-capacity", "16384", log=log, nofile=(1024, 1024)) as c:
        assert c.proc is not None and _soft_nofile(c.proc.pid) == ("1024", "1024")
        r = httpx.post(f"{c.url}/v1/ingest", content=_body("r", 0, G1 | 1, [make_report(0)]), headers=AUTH)
        assert r.status_code == 200, r.text
    warnings = [ln for ln in log.read_text().splitlines() if " WARNING " in ln and "open files" in ln]
    assert len(warnings) == 1, warnings
    w = warnings[0]
    assert "hard limit (ulimit -Hn) is 1024" in w and "enough for 256 ranks" in w
    assert "--rank-capacity asks 16384" in w and f"raise the hard limit to {files_needed(16384, 1000)}" in w


@pytest.mark.integration
def test_the_default_capacity_short_of_the_limit_is_said_at_debug_level_only(tmp_path: Path) -> None:
    """Hard 1,024 and the default capacity (--max-ranks, 16,384: the largest job, not the 2 ranks
    at hand): no WARNING at start (issue #37: one at every start cried wolf); --log-level debug
    shows the same line once, at DEBUG."""
    for level, want in (("info", 0), ("debug", 1)):
        log = tmp_path / f"collector-{level}.log"
        with collector_under(tmp_path, "--log-level", level, log=log, nofile=(1024, 1024)) as c:
            r = httpx.post(
                f"{c.url}/v1/ingest", content=_body("r", 0, G1 | 1, [make_report(0)]), headers=AUTH
            )
            assert r.status_code == 200, r.text
        lines = [ln for ln in log.read_text().splitlines() if "hard limit (ulimit -Hn)" in ln]
        assert " WARNING " not in log.read_text()
        assert len(lines) == want and all(" DEBUG " in ln for ln in lines), lines


@pytest.mark.integration
@pytest.mark.parametrize(("http", "loop"), STACKS)
def test_more_idle_connections_than_files_neither_crash_nor_flood_the_log(
    tmp_path: Path, http: str, loop: str
) -> None:
    """Hard limit 1,024, capacity 300 ranks: 1,074 idle connections at once (50 more than the process
    may open files; a cap above the limit makes asyncio log EMFILE tracebacks) while the collector serves. It stays up, its log stays a few lines with no
    traceback, and once they close a normal batch gets 200."""
    log = tmp_path / "collector.log"
    flags = ("--rank-capacity", "300", "--max-hot-runs", "50", "--http", http, "--loop", loop)
    flags += ("--header-timeout", "60")  # the flood stays open: only the budget closes connections
    with collector_under(tmp_path, *flags, log=log, nofile=(1024, 1024)) as c:
        assert c.proc is not None
        conns = httpx.get(f"{c.url}/healthz", timeout=5).json()["connections"]
        assert conns["cap"] == 1024 - (50 + 128 + 64) and conns["ranks_covered"] == conns["cap"] // 2
        before = len(log.read_text().splitlines())
        flood = idle_sockets(c.port, 1024 + 50)
        try:
            time.sleep(1.0)
            assert c.proc.poll() is None
            during = httpx.get(f"{c.url}/healthz", timeout=5)
        finally:
            for s in flood:
                s.close()
        assert during.status_code == 200 and during.json()["connections"]["open"] <= conns["cap"]
        time.sleep(0.5)
        r = httpx.post(f"{c.url}/v1/ingest", content=_body("r", 0, G1 | 1, [make_report(0)]), headers=AUTH)
        assert r.status_code == 200, r.text
        assert c.proc.poll() is None
    lines = log.read_text().splitlines()[before:]
    assert "Traceback" not in "\n".join(lines)
    assert len(lines) < 20, lines[:20]


def test_the_plan_shares_out_the_limit_in_force() -> None:
    """In this process: the soft limit already covers 10 ranks, so nothing is raised and the
    connections get all that the files leave; an explicit --max-connections is kept as given."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < files_needed(10, 5):
        pytest.skip(f"soft limit {soft}")
    p = plan_open_files(10, 5)
    assert (p.before, p.nofile) == (soft, soft) and p.cap == soft - (5 + 128 + 64)
    assert p.ranks_covered == p.cap // 2 and not p.short and p.warning() is None
    q = plan_open_files(100, 5, max_connections=50)
    assert q.cap == 50 and q.ranks_covered == 25 and q.short
    assert "enough for 25 ranks (--rank-capacity asks 100)" in (q.warning() or "")
