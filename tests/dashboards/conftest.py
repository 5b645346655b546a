"""Fixtures for the app tests: a synthetic run store (written through RunStore), a canary
history, and `open_page()` to run one page of the app under streamlit's AppTest.

Set MOEGUARD_REAL_RUNS=/path/to/runs to also run the page smoke test over real trainer runs.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

import dashboards
from dashboards.data import config
from guard.core import schema
from tests.dashboards.synth_store import LIVE, make_store, set_meta, write_canary_history

APP = Path(dashboards.__file__).resolve().parent / "app.py"  # the checkout's, or the installed wheel's


@pytest.fixture(scope="session")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    make_store(root)
    return root


@pytest.fixture(autouse=True)
def _live_run_stays_live(request: pytest.FixtureRequest) -> None:
    """The session's store is written when a worker first needs it, maybe many minutes before a
    test reads it (CI's parallel phase runs ~17 min); its running run would then read as stale
    (DEFAULT_STALE_S, 5 min without activity), as a real one does. Each test that uses the store
    sees that run active just now (its meta.json's updated_at)."""
    if "store" in request.fixturenames:  # some modules define a `store` of their own, without it
        live = Path(request.getfixturevalue("store")) / LIVE
        if (live / schema.META_FILE).is_file():
            set_meta(live, updated_at=time.time())


@pytest.fixture(scope="session")
def history(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_canary_history(tmp_path_factory.mktemp("canary") / "history.jsonl")


@pytest.fixture
def open_page(monkeypatch: pytest.MonkeyPatch):
    """open_page(page, runs_dir, run=None, history=None) -> AppTest after running the page."""

    def _open(
        page: str, runs_dir: Path, *, run: str | None = None, history: Path | None = None, timeout: float = 60
    ) -> AppTest:
        monkeypatch.setenv(config.ENV_RUNS, str(runs_dir))
        if history is not None:
            monkeypatch.setenv(config.ENV_HISTORY, str(history))
        else:
            monkeypatch.delenv(config.ENV_HISTORY, raising=False)
        at = AppTest.from_file(str(APP), default_timeout=timeout).run()
        if page != "runs":
            at.switch_page(f"page_{page}.py")
            if run is not None:
                at.query_params["run"] = run
            at.run()
        return at

    return _open
