"""The Canaries page's A/B section: ab.json found where `moeguard canary --ab` writes it, read with
the canary's own format module, shown as the verdict, the per-pair chart, the environment diff and
the changed ops. Reports are written by the canary's real writer (tests/dashboards/synth_ab.py);
the screenshot test (test_canary_ab_screenshot.py) uses a real A/B run."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import pytest

from dashboards import launch
from dashboards.data import canary_ab, config
from guard.canary import ab_format
from tests.dashboards.app_helpers import chart_titled, messages, traces
from tests.dashboards.synth_ab import write_ab_report

SLOWER = [0.95, 0.96, 0.94, 0.97, 0.95, 0.96]  # every pair below the 1% line: fail


def test_reports_are_found_where_the_canary_writes_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = tmp_path / "runs"
    monkeypatch.delenv(config.ENV_AB_REPORTS, raising=False)
    assert config.app_config(["--runs", str(runs)]).ab_reports == runs / ab_format.REPORT_DIR
    other = tmp_path / "elsewhere.json"
    assert config.app_config(["--runs", str(runs), "--ab-reports", str(other)]).ab_reports == other
    monkeypatch.setenv(config.ENV_AB_REPORTS, str(other))
    assert config.app_config(["--runs", str(runs)]).ab_reports == other
    monkeypatch.delenv(config.ENV_AB_REPORTS)
    root = runs / ab_format.REPORT_DIR
    oldest = write_ab_report(root, SLOWER)
    arm = write_ab_report(root / "ab-clean-1", [1.0, 0.99, 1.01, 1.0])
    cell = write_ab_report(root / "cells" / "experts_bmm", [1.02, 1.03, 1.01, 1.04])
    now = time.time()
    for age, p in ((30, oldest), (20, arm), (10, cell)):
        os.utime(p, (now - age, now - age))
    assert canary_ab.report_paths(root) == [cell, arm, oldest]  # newest first, a matrix's cells included
    assert canary_ab.report_paths(oldest) == [oldest]
    assert canary_ab.report_paths(tmp_path / "missing") == []
    args = argparse.Namespace(runs=str(runs), port=8501, host="127.0.0.1", history=None, collector=None)
    args.ab_reports = str(root)
    cmd = launch.streamlit_command(args)
    assert cmd[cmd.index("--ab-reports") + 1] == str(root.resolve())


def test_tables_from_a_report_the_canary_wrote(tmp_path: Path) -> None:
    path = write_ab_report(tmp_path, SLOWER)
    rep, why = canary_ab.load_report(str(path), path.stat().st_mtime_ns)
    assert rep is not None and why == ""
    assert rep["verdict"] == "fail" and rep["statistic"]["n_pairs"] == 6
    pairs = canary_ab.pairs_table(rep)
    assert pairs["B/A (gated)"].to_list() == pytest.approx(SLOWER)
    assert pairs["order"].to_list() == ["AB", "BA"] * 3
    assert canary_ab.interval_words(rep).startswith("[0.9400, 0.9700], 96.9% sign-test coverage over 6 pairs")
    env = canary_ab.env_table(rep, only_differences=True)
    assert dict(zip(env["key"], zip(env["A"], env["B"], strict=True), strict=True)) == {
        "torch": ("2.13.0+cpu", "2.14.1+cu130"),
        "expert_kernel": ("grouped_mm", "bmm"),
        "overrides": ("set:", "set:model.experts_kernel=bmm"),
    }
    ops = canary_ab.ops_table(rep, "host")
    assert ops["op"][0] == "aten::bmm" and ops["B - A ms"][0] == pytest.approx(2.0)
    new = ops.filter(ops["op"] == "aten::new_op").row(0, named=True)
    assert new["A ms"] is None and new["B ms"] == pytest.approx(0.5)  # an op that only B ran
    sides = canary_ab.sides_table(rep)
    assert sides["environment"].to_list() == ["set:", "set:model.experts_kernel=bmm"]
    assert "B/A 0.9550" in canary_ab.report_label(path, tmp_path, rep)
    assert canary_ab.report_label(path, path, rep).endswith(f"({tmp_path})")  # --ab-reports FILE


def test_a_file_that_is_no_ab_report_is_named_not_raised(tmp_path: Path) -> None:
    bad = tmp_path / ab_format.AB_JSON
    bad.write_text('{"kind": "ab", "verdict": "pass"}')
    rep, why = canary_ab.load_report(str(bad), bad.stat().st_mtime_ns)
    assert rep is None and str(bad) in why and "is missing" in why


def test_canaries_page_shows_the_ab_report(
    store: Path, tmp_path: Path, open_page, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_ab_report(tmp_path / "reports", SLOWER)
    monkeypatch.setenv(config.ENV_AB_REPORTS, str(path))  # one file (the screenshot test: the default folder)
    at = open_page("canaries", store)
    assert not at.exception
    fig = chart_titled(at, "A/B canary: B/A per pair (FAIL)")
    gated = traces(fig, "B/A, A ran first")[0]["y"] + traces(fig, "B/A, B ran first")[0]["y"]
    assert sorted(gated) == pytest.approx(sorted(SLOWER))
    assert traces(fig, "median 0.9550") and traces(fig, "fail line (0.990)")
    assert traces(fig, "interval [0.9400, 0.9700]")
    assert any(e.value.startswith("**FAIL**") for e in at.error)
    text = " ".join(m.value for m in at.markdown)
    assert "**torch** (A `2.13.0+cpu`, B `2.14.1+cu130`)" in text
    assert {m.label: m.value for m in at.metric}["median B/A"] == "0.9550 (-4.50%)"
    assert len(at.dataframe) >= 3  # env, host ops, pairs (and sides)


def test_canaries_page_says_where_it_looked_for_ab_reports(
    store: Path, tmp_path: Path, open_page, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(config.ENV_AB_REPORTS, str(tmp_path / "none"))
    at = open_page("canaries", store)
    assert not at.exception
    assert any("No A/B canary report" in m and str(tmp_path / "none") in m for m in messages(at))
