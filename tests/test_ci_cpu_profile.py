"""scripts/ci_cpu_profile.py charges each process to the test its worker ran when it started, through
any depth of parents, with pids reused, and lists what no worker started apart."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from tests.conftest import REPO

spec = importlib.util.spec_from_file_location("ci_cpu_profile", REPO / "scripts" / "ci_cpu_profile.py")
prof = importlib.util.module_from_spec(spec)
spec.loader.exec_module(prof)


def record(pid: int, ppid: int, start: int, secs: float, cpu_s: float, comm: str) -> bytes:
    ticks = round(cpu_s * prof.AHZ)  # under 8,192 ticks: comp_t's exponent 0
    assert ticks < 1 << 13
    return prof.ACCT_V3.pack(
        0, 3, 0, 0, 0, 0, pid, ppid, start, secs * prof.AHZ, ticks, 0, 0, 0, 0, 0, 0, 0, comm.encode()
    )


def test_processes_are_charged_to_the_test_their_worker_ran_when_they_started(tmp_path: Path) -> None:
    w = 100  # the worker: tests a (t 1000-1010) and b (1010-1030)
    tests = [
        {"id": "m.py::a", "t0": 1000.0, "wall": 10.0, "self": 2.0, "pid": w},
        {"id": "m.py::b", "t0": 1010.0, "wall": 20.0, "self": 1.0, "pid": w},
    ]
    (tmp_path / "gw0.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tests))
    recs = [
        record(200, w, 1001, 5, 3.0, "pt_elastic"),  # a's torchrun agent
        record(201, 200, 1002, 4, 7.5, "python"),  # its rank: a grandchild
        record(200, w, 1012, 3, 4.0, "python"),  # pid 200 again, in b: b's, and not 201's parent
        record(300, 1, 1015, 2, 9.0, "python"),  # reparented to init: no worker's
        record(w, 50, 990, 60, 12.0, "python"),  # the worker itself: its tests hold its CPU
    ]
    (tmp_path / "pacct").write_bytes(b"".join(recs))
    procs = prof.read_pacct(tmp_path / "pacct")
    assert [p["cpu"] for p in procs] == [3.0, 7.5, 4.0, 9.0, 12.0]
    cpu, count, orphans = prof.charge(procs, prof.read_tests(tmp_path))
    assert cpu == {"m.py::a": 2.0 + 3.0 + 7.5, "m.py::b": 1.0 + 4.0}
    assert count == {"m.py::a": 2, "m.py::b": 1} and orphans == {"python": 9.0}
    assert prof.main([str(tmp_path)]) == 0


def test_comp_t_reads_its_exponent() -> None:
    assert prof._comp(5) == 5 and prof._comp((2 << 13) | 3) == 3 * 64
