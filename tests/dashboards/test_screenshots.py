"""Screenshots of every page on real trainer runs that differ in expert kernel and in torch
version (issue #17), in Chromium, saved under test-output/screenshots/ for a person to look at.

The runs are real `moeguard train` runs of the micro model (bmm and loop kernels). One torch
is installed, so the torch difference is fabricated: a third real run (another seed) whose
meta.json says torch 2.12.1 and says that it was relabelled. An older-style run whose peak was
self-measured (MFU above 100%) is written by the synthetic writer, and an unguarded run that
went NaN at step 50 and trained on to its end is real. Point
MOEGUARD_SCREENSHOT_RUNS at another run store to shoot that instead (the canary history is the
repository's own, configs/canary_history/ci-cpu.jsonl)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from guard.store.layout import atomic_write_json
from guard.store.reader import list_runs
from tests.conftest import MICRO, REPO
from tests.dashboards import synth_run as synth
from tests.dashboards.test_app_browser import CHROMIUM, _chromium, _screenshot, serve

pytestmark = [pytest.mark.integration, pytest.mark.slow]
HISTORY = REPO / "configs" / "canary_history" / "ci-cpu.jsonl"
OUT = REPO / "test-output" / "screenshots"


def _train(run_dir: Path, *args: str) -> None:
    """`moeguard train` of the micro config, in this process (the CLI's own entry point, not a
    subprocess: its exit code is checked, and the interpreter's and torch's start-up are paid once
    for the five runs). torch's thread count, which the run sets, is put back for the next test."""
    import torch

    from guard.cli import main

    threads = torch.get_num_threads()
    try:
        code = main(
            ["train", "--config", str(MICRO), "--run-dir", str(run_dir), "--steps", "80", "--no-progress",
             "--set", "train.threads=1", "--set", "telemetry.profile=true", *args]
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert code == 0, f"moeguard train {run_dir.name}: exit {code}"


def make_runs(root: Path) -> None:
    _train(root / "kernel-bmm", "--set", "model.experts_kernel=bmm")
    _train(
        root / "kernel-loop",
        "--set",
        "model.experts_kernel=loop",
        "--inject",
        "gradspike@40:1000",
        "--inject",
        "collapse@45:1",
    )
    # issue #31: a collapse injected inside the collapse detector's warm-up (it arms at step 20 on
    # the micro config), and a steps part truncated afterwards as a crash or a full disk leaves it
    _train(root / "warmup-and-damaged-part", "--inject", "collapse@8:1")
    part = sorted((root / "warmup-and-damaged-part" / "steps").glob("part-*.parquet"))[3]
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    # unguarded, NaN from step 50 to the end: the trainer ends it finished_nonfinite
    _train(root / "nan-unguarded", "--set", "model.experts_kernel=bmm", "--no-guard", "--inject", "nan@50")
    fake = root / "torch-2.12.1-fabricated"
    _train(fake, "--set", "model.experts_kernel=bmm", "--seed", "1")
    meta = json.loads((fake / "meta.json").read_text())
    meta["env"]["note"] = (
        f"torch {meta['env']['torch']} run relabelled 2.12.1 for the screenshots (one torch here)"
    )
    meta["env"]["torch"] = "2.12.1+cpu"
    atomic_write_json(fake / "meta.json", meta)
    env = {
        **synth.ENV_A,
        "torch": "2.13.0+cpu",
        "cuda": "none",
        "device": "cpu:x86_64:2threads",
        "world_size": 1,
        "peak_flops": 1.6e10,
        "peak_flops_source": "measured: cpu matmul probe fp32 2 threads",
        "expert_kernel": "bmm",
        "compile": False,
        "dtype": "fp32",
    }
    synth.write_run(
        root,
        synth.SynthRun(
            run_id="legacy-self-peak-synthetic",
            steps=300,
            env=env,
            mfu=1.7,
            faults=synth.default_faults()[:1],
            seed=11,
        ),
    )


def test_screenshots_of_every_page(tmp_path: Path) -> None:
    playwright = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} not installed")
    root = Path(os.environ.get("MOEGUARD_SCREENSHOT_RUNS") or tmp_path / "runs")
    if not os.environ.get("MOEGUARD_SCREENSHOT_RUNS"):
        make_runs(root)
    runs = [p.name for p in list_runs(root)]
    kernels = sorted(r for r in runs if r.startswith("kernel-"))
    legacy = [r for r in runs if "self-peak" in r]
    fake = [r for r in runs if "fabricated" in r]
    assert len(kernels) >= 2 and fake, runs
    sel = "&".join(f"runs={r}" for r in [*kernels, *fake])
    views = [("runs", "/runs", 0)]
    views += [(f"health-{r}", f"/health?run={r}", 8) for r in runs]
    views += [
        ("compare-kernels-tokens", f"/compare?{sel}", 2),
        ("compare-kernels-mfu-wall", f"/compare?{sel}&metric=MFU&x_axis=wall+time", 2),
        ("compare-loss-tokens", f"/compare?{sel}&metric=loss&x_axis=tokens&group_by=expert+kernel", 2),
    ]
    if legacy:
        views.append(
            ("compare-with-legacy-mfu", f"/compare?runs={legacy[0]}&runs={kernels[0]}&metric=MFU", 2)
        )
    views.append(("canaries", "/canaries", 1))
    OUT.mkdir(parents=True, exist_ok=True)
    # one store's pages, not a mix with an earlier store's; other tests' shots (canaries-ab.png) stay
    for pattern in ("runs.png", "health-*.png", "compare-*.png", "canaries.png"):
        for old in OUT.glob(pattern):
            old.unlink()
    results = {}
    with serve(root, HISTORY, tmp_path / "app.log") as base, playwright.sync_playwright() as p:
        browser = _chromium(p)
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        for name, path, min_charts in views:
            page.set_viewport_size({"width": 1600, "height": 1000})
            shot = tmp_path / f"{name}.png"
            table = "[data-testid=stDataFrame]" if name == "runs" else None
            results[name] = _screenshot(page, base + path, shot, min_charts=min_charts, selector=table)
            shutil.copy(shot, OUT / shot.name)
        browser.close()
    for name, r in results.items():
        assert r["exceptions"] == 0, f"{name}: Streamlit shows an exception"
        assert "Page not found" not in r["text"] and "Traceback" not in r["text"], name
    said = results["compare-kernels-tokens"]["text"]
    assert "No clear difference" in said or "% higher" in said or "% lower" in said, said[:2000]
    assert "% faster than" not in said  # issue #31: a within-run interval cannot say B is faster
    # issue #31: the damaged part is named, the rest of its run drawn, its warm-up shaded
    damaged = results.get("health-warmup-and-damaged-part")
    if damaged is not None:
        assert "damaged part file(s) skipped" in damaged["text"] and "steps/part-" in damaged["text"]
        assert "collapse warm-up: arms at step 20 (collapse.warmup)" in damaged["text"]
        assert "damaged part" in results["runs"]["text"]
    # the overlay follows its URL (?metric=MFU&x_axis=wall+time), so a view can be shared
    assert (
        "MFU (%) by wall time since the first step (s), runs overlaid"  # 80 micro steps: seconds
        in results["compare-kernels-mfu-wall"]["text"]
    )
    assert "Loss (nats/token) by tokens consumed" in results["compare-loss-tokens"]["text"]
    if legacy:
        assert "measurement artefact" in results["compare-with-legacy-mfu"]["text"]
    # every column of the Runs table on screen at 1,600 px with the sidebar open, no scrolling
    assert max(results["runs"]["table_overflow_px"]) <= 1, results["runs"]["table_overflow_px"]
    for name, r in results.items():  # a NaN-ended run is said to be one wherever it is shown
        if name == "runs" or "nan-unguarded" in name:
            assert "finished, non-finite" in r["text"], name
