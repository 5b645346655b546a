"""moeguard run-health app.

    moeguard app --runs DIR [--history FILE] [--collector URL]
    streamlit run dashboards/app.py -- --runs DIR          (the same thing, by hand)

The entry script only sets up navigation and the shared sidebar; each page is a thin
script (page_*.py) over the cached loaders in dashboards/data/.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

# `streamlit run dashboards/app.py` puts dashboards/ on sys.path, not the repository root
_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import streamlit as st  # noqa: E402

from dashboards.data import config, loaders, runs  # noqa: E402
from guard.store import reader  # noqa: E402

LIVE_EVERY_S = float(os.environ.get("MOEGUARD_APP_LIVE_S", "30"))

st.set_page_config(page_title="moeguard", page_icon=":material/shield:", layout="wide")
cfg = config.app_config()

RUNS = st.Page("page_runs.py", title="Runs", icon=":material/list:", url_path="runs")


def _home() -> None:
    """`/` opens the Runs page at its own URL. (A default page is served at `/` only, so with
    Runs as the default, a bookmarked or typed `/runs` answered "Page not found".)"""
    st.switch_page(RUNS)


nav = st.navigation(
    [
        st.Page(_home, title="Runs", url_path="home", default=True, visibility="hidden"),
        RUNS,
        st.Page("page_health.py", title="Run health", icon=":material/monitor_heart:", url_path="health"),
        st.Page("page_compare.py", title="Compare", icon=":material/compare_arrows:", url_path="compare"),
        st.Page("page_canaries.py", title="Canaries", icon=":material/trending_down:", url_path="canaries"),
    ]
)
with st.sidebar:
    st.caption(f"Run store: `{cfg.runs_dir}`")
    st.number_input(
        "Stale after (s)",
        min_value=10,
        value=int(runs.DEFAULT_STALE_S),
        step=60,
        key="stale_after_s",
        help="A run still marked running whose last write is older than this shows as stale.",
    )
    st.toggle(
        "Show canary worker runs",
        key="show_canary",
        help="Runs that `moeguard canary` measured (meta.json 'canary'); hidden so they do not crowd "
        "out the runs you trained. New canaries write theirs under RUNS/canary-runs/.",
    )
    live = st.toggle(
        "Live (rerun every 30 s)", key="live", help="Follow running runs: new parts are read as they land"
    )
    if st.button(
        "Reload data", help="Drop cached tables (they also refresh by themselves when a run writes)"
    ):
        loaders.clear_caches()

if live:
    # A timer fragment that reruns the whole app. Cached loaders are keyed by each run's
    # signature, so a rerun re-reads only runs that gained part files.
    st.session_state["_full_run_at"] = time.time()

    @st.fragment(run_every=LIVE_EVERY_S)
    def _live_tick() -> None:
        if time.time() - st.session_state.get("_full_run_at", 0.0) >= LIVE_EVERY_S - 1:
            st.rerun(scope="app")

    with st.sidebar:
        _live_tick()
# A compaction (the collector's or the job's store upkeep, guard/store/compaction.py) may delete
# the parts it merged between this rerun's listing of a table and its read of them: the read
# then fails on a part that is gone. That rerun lists again (the merged part holds the same
# rows); a part still missing after that is a real error and shows as one.
VANISHED_RERUNS = 3

try:
    nav.run()
except FileNotFoundError as e:
    # polars names the part in its message (shortened), Python's own errors in `filename`
    if ".parquet" not in str(e.filename or e) or st.session_state.get("_vanished", 0) >= VANISHED_RERUNS:
        raise
    st.session_state["_vanished"] = st.session_state.get("_vanished", 0) + 1
    reader.clear_cache()
    st.rerun()
st.session_state["_vanished"] = 0
