"""Long synthetic run stores (bench/scale/month_store.py's fast build) shared by the issue #38
modules test_compare_long_run.py and test_health_long_run.py: both read the same 3,000- and
48,000-step runs of one shape, and neither writes to a store, so each is built once per test
session. Under pytest-xdist the two modules may run on different workers, so a built store lives
in the session's shared temp folder (the parent of each worker's basetemp, the pattern of
pytest-xdist's docs), its build guarded by a file lock: the first worker builds, the other waits
and reads it."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from bench.scale.month_store import write_month_run

SHAPE = {"layers": 2, "experts": 4, "ranks": 0, "incident_every": 5000, "recent": 1000, "radius": 20}
RUN = "long"  # each store's one run: <root>/long


def month_store(tmp_path_factory: pytest.TempPathFactory, steps: int) -> Path:
    """The root of a store holding one run, RUN, of `steps` steps at SHAPE (built once a session)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    root = shared / f"month-store-{steps}"
    done = shared / f"month-store-{steps}.done"
    with open(shared / f"month-store-{steps}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            if root.exists():  # a build that died half-way in this session: start over
                import shutil

                shutil.rmtree(root)
            write_month_run(root / RUN, steps=steps, **SHAPE)
            done.touch()
    return root
