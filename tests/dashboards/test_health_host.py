"""Host utilisation on Run health beside throughput (issue #40), on the page's step axis; a run
without host samples (written before the table, or sampling off) draws no panel."""

from __future__ import annotations

from pathlib import Path

import pytest
from app_helpers import chart_titled, charts, traces

from guard.store.runstore import RunStore
from tests.dashboards.synth_run import T0, SynthRun, write_run

HOST_TITLE = "Host utilisation"


@pytest.fixture(scope="module")
def host_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("host")
    write_run(root, SynthRun(run_id="no-host", steps=40, faults=[]))
    d = write_run(root, SynthRun(run_id="with-host", steps=40, faults=[]))
    store = RunStore(d)
    for step in range(0, 40, 4):
        store.add_host_row(
            {
                "step": step,
                "time": T0 + step,
                "cpu_pct": 95.0 + step % 3,
                "rss_bytes": (2 + step / 40) * 2**30,
                "host_mem_used_bytes": 6 * 2**30,
                "host_mem_total_bytes": 16 * 2**30,
                "gpu_util_pct": None,
                "gpu_mem_used_bytes": None,
            }
        )
    store.close()
    return root


def test_host_panel_beside_throughput(host_store: Path, open_page) -> None:
    at = open_page("health", host_store, run="with-host")
    assert not at.exception, [e.value for e in at.exception]
    fig = chart_titled(at, HOST_TITLE)
    (cpu,) = traces(fig, "process CPU")
    assert cpu["x"] == list(range(0, 40, 4)) and cpu["y"][0] == pytest.approx(95.0)
    (rss,) = traces(fig, "process RSS")
    assert rss["y"][0] == pytest.approx(2.0)  # GiB
    assert not traces(fig, "GPU utilisation") and not traces(fig, "GPU memory used")  # none measured
    perf = chart_titled(at, "Throughput, efficiency and memory")
    assert fig["layout"]["xaxis"]["range"] == perf["layout"]["xaxis"]["range"] == [-0.5, 39.5]
    titles = [str(f["layout"].get("title", {}).get("text", "")) for f in charts(at)]
    assert titles.index(fig["layout"]["title"]["text"]) == titles.index(perf["layout"]["title"]["text"]) + 1
    # how many samples the panel draws (a 1-s Trainer run had two, at the right edge, and said nothing)
    assert any(c.value.startswith("10 samples in the steps shown.") for c in at.caption)


def test_no_host_panel_without_samples(host_store: Path, open_page) -> None:
    at = open_page("health", host_store, run="no-host")
    assert not at.exception, [e.value for e in at.exception]
    assert not [
        f for f in charts(at) if str(f["layout"].get("title", {}).get("text", "")).startswith(HOST_TITLE)
    ]
