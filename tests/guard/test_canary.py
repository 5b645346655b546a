"""`moeguard canary`: the gate (record, pass, injected slowdown fails), reports, matrix, history.

The end-to-end tests run real canary measurements (worker processes) on the shipped canary
model run short; the gate is loosened and the injected slowdown made large (40%) so the verdicts are
unambiguous on a loaded 2-core machine. The bench (bench/canary/canary_power.py) measures the real
gate's power.

The end-to-end tests are `serial` (scripts/test runs them alone, after the parallel phase): the gate tests
bound a measured MFU, and the ones that only read the module's recorded baseline share that
measurement, which is taken once, in the serial phase, rather than again in the parallel one.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from guard.canary import config, gate, history, keys, matrix, profile, report, stats
from guard.canary.ab_format import WORKER_RUNS_DIR
from guard.cli import main
from guard.core.tomlconf import ConfigError

# The shipped canary model (configs/canary.toml: ~25 ms steps) run short: ~100 steps, profiler window
# at steps 3-5. A shrunken model (d_model 32, one layer: ~3 ms steps) was tried and dropped: its
# worker processes differ by up to 50% on an idle 2-core host (cache luck of a model that nearly
# fits), and a fresh-clone CI once recorded such a baseline 28% below the host's usual MFU, which
# runs slowed by 40% then merely matched (-7%, +4%): the gate passed them.
SHORT = [
    "train.steps=80",
    "data.max_bytes=200000",
    "telemetry.profile_wait=3",
    "telemetry.profile_warmup=1",
    "telemetry.profile_active=1",
    "canary.warmup_steps=20",
    "canary.processes=2",  # two worker processes: the pooled path, still quick
    # Loose gates: a clean run must pass on a loaded machine, a 40% slowdown (-29% MFU) must fail.
    "canary.mfu_warn_pct=12",
    "canary.mfu_fail_pct=15",
    "canary.tokens_cpu_warn_pct=60",
    "canary.tokens_cpu_fail_pct=70",
    "canary.tokens_warn_pct=60",
    "canary.tokens_fail_pct=70",
    "canary.mem_warn_pct=50",
    "canary.mem_fail_pct=80",
    "canary.data_wait_warn_pp=20",
    "canary.data_wait_fail_pp=40",
    "canary.baseline_min_span_h=0",  # the shipped config's 24 h would keep MFU warn-only here
]


def _sets(items: list[str]) -> list[str]:
    return [a for s in items for a in ("--set", s)]


def _canary(tmp: Path, *extra: str, report: str = "rep") -> int:
    return main(
        [
            "canary",
            "--history",
            str(tmp / "h.jsonl"),
            "--runs",
            str(tmp / "runs"),
            "--report-dir",
            str(tmp / report),
            *_sets(SHORT),
            *extra,
        ]
    )


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A history with one baseline entry recorded by `--record` (shared by the gate tests)."""
    tmp = tmp_path_factory.mktemp("canary")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert _canary(tmp, "--record", report="rep-record") == 0
    (tmp / "record.out").write_text(out.getvalue())
    return tmp


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.unpaired  # its baseline entries are separate runs: a neighbour skews them
def test_record_appends_a_baseline_entry(recorded: Path) -> None:
    e = json.loads((recorded / "h.jsonl").read_text().splitlines()[0])  # later tests may --append more
    for key in (
        "time",
        "git_sha",
        "torch",
        "fingerprint",
        "hardware",
        "config_hash",
        "config",
        "mfu_p50",
        "tokens_per_s_p50",
        "mem_peak_bytes",
        "data_wait_share",
        "final_loss",
        "verdict",
        "baseline",
    ):
        assert key in e, key
    assert e["baseline"] is True and e["verdict"] == "pass"
    assert 0 < e["mfu_p50"] < 5 and e["tokens_per_s_p50"] > 0 and e["mem_peak_bytes"] > 0
    assert e["config_hash"] in e["fingerprint"]
    # The first run had no baseline and --record made it one: no "record one with --record" hint
    # (issue #17 item 10: that hint on the very command that records it read as an error).
    rep = json.loads((recorded / "rep-record" / "canary.json").read_text())
    assert "no baseline" not in rep["notice"] and "record one" not in rep["notice"]
    # ... and it is a run in the run store, marked as a canary run.
    run_dir = Path(rep["runs"][0]["run_dir"])
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["status"] == "finished" and meta["canary"]["timing"] in ("cpu", "wall")
    # It says what it recorded and that nothing was compared (issue #31, item 10), not a bare PASS.
    said = (recorded / "record.out").read_text()
    assert "nothing compared" in said and "no baseline" in said, said
    assert f"appended this run (1 measurement(s)) to {recorded / 'h.jsonl'} as a baseline entry" in said, said
    assert "nothing was compared (there was no baseline yet)" in said, said
    # One MFU (issue #31, item 4): the CPU canary's gated number is named apart from MFU, MFU is the
    # trainer's (the Runs page's) with the peak it divides by, and the definition is printed.
    if rep["timing"] == "cpu":
        assert "CPU efficiency p50" in said and "(gated; vs the reference matmul)" in said, said
    assert "; MFU p50 " in said or said.count("MFU p50") == 1, said
    assert keys.MFU_DEFINITION in said
    md = (recorded / "rep-record" / "canary.md").read_text()
    assert "Wall clock (not gated on CPU): MFU p50" in md and (" of peak " in md or "no peak for this" in md)
    # ... kept apart from the user's runs (issue #31, item 7): RUNS/canary-runs/, not RUNS/
    assert run_dir.parent == (recorded / "runs" / WORKER_RUNS_DIR).resolve()
    assert [p.name for p in (recorded / "runs").iterdir() if (p / "meta.json").is_file()] == []


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.unpaired  # its baseline entries are separate runs: a neighbour skews them
def test_an_injected_slowdown_fails_when_its_rerun_repeats_it(
    recorded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On the module's one-entry baseline, with loose lines. (A clean run passing, and --append
    adding a trend entry that is no part of the baseline, are shown on the three-entry history
    below: one canary run fewer in the serial phase.)"""
    capsys.readouterr()
    assert _canary(recorded, "--inject", "slow:40", report="rep-slow") == 1
    slow = json.loads((recorded / "rep-slow" / "canary.json").read_text())
    assert slow["verdict"] == "fail" and slow["exit_code"] == 1
    assert slow["baseline"]["n"] == 1
    gated = keys.MFU_ADJ if slow["timing"] == "cpu" else keys.MFU  # CPU: the host-adjusted MFU
    assert gated in slow["regressed_metrics"]
    assert len(slow["runs"]) == 2  # the regression was re-run once and repeated
    mfu_decision = next(d for d in slow["decision"] if d["metric"] == gated)
    assert mfu_decision["final"] == "fail" and mfu_decision["pooled_delta"] < -15
    for run in slow["runs"]:
        mfu = next(r for r in run["comparison"] if r["metric"] == gated)
        assert mfu["level"] in ("warn", "fail") and mfu["delta"] < -12
    # One baseline entry of two processes is too few to fit the host: the adjustment is off, said so.
    assert slow["host_fit"]["n"] == 0
    out = capsys.readouterr().out
    assert f"canary FAIL: {gated}" in out
    md = (recorded / "rep-slow" / "canary.md").read_text()
    assert md.startswith("# Canary: FAIL") and "## Run 2" in md and "## Decision: both runs" in md
    assert f"regressed (fail): {gated}" in md and "host adjustment: none" in md


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.unpaired  # its baseline entries are separate runs: a neighbour skews them
def test_a_fresh_three_entry_history_fails_a_30pct_slowdown_from_the_first_day(
    recorded: Path, tmp_path: Path
) -> None:
    """Issue #15: three --record baselines back to back (span ~minutes, far below the shipped 24 h),
    the shipped MFU lines (-2/-3%), the shipped model run short: --inject slow:30 exits non-zero, a
    clean run exits 0 (with --append: a trend entry, no part of the baseline). The first of the three is this module's own --record run (the same model,
    config hash and host, minutes earlier), so two more are recorded here, not three.

    The shipped config's rule on the way: a CPU baseline that spans less than baseline_min_span_h
    widens the MFU fail line (gate.young_fail_line) instead of disarming it, and says so in the
    report; the slowdown still fails. (A separate one-entry case of the rule used to cost the
    serial phase one more canary run; young_fail_line's arithmetic is unit-tested below.)"""
    first = (recorded / "h.jsonl").read_text().splitlines()[0]  # later lines may be --append'ed trend
    (tmp_path / "h.jsonl").write_text(first + "\n")
    young = [
        "--set",
        "canary.baseline_min_span_h=24",
        "--set",
        "canary.mfu_warn_pct=2",
        "--set",
        "canary.mfu_fail_pct=3",
    ]
    for i in range(1, 3):
        code = _canary(tmp_path, "--record", "--set", "canary.confirm=false", *young, report=f"rec{i}")
        assert code == 0
    lines = [json.loads(x) for x in (tmp_path / "h.jsonl").read_text().splitlines()]
    assert len(lines) == 3 and all(e["baseline"] for e in lines)
    # a clean run passes, and --append adds it as a trend entry, not a baseline
    assert _canary(tmp_path, "--append", *young, report="clean") == 0
    clean = json.loads((tmp_path / "clean" / "canary.json").read_text())
    assert clean["verdict"] in ("pass", "warn") and clean["baseline"]["n"] == 3
    lines = (tmp_path / "h.jsonl").read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[3])["baseline"] is False
    assert _canary(tmp_path, "--inject", "slow:30", *young, report="slow") != 0
    slow = json.loads((tmp_path / "slow" / "canary.json").read_text())
    assert slow["baseline"]["n"] == 3  # the --append'ed entry is no part of the baseline
    if slow["timing"] == "cpu":  # on a GPU host (wall-clock timing) the span rule is off by design
        assert keys.MFU_ADJ in slow["regressed_metrics"]
        mfu_gate = slow["mfu_gate"]
        assert (
            mfu_gate["widened"] and 10 <= mfu_gate["fail_pct"] <= 20 and mfu_gate["configured_fail_pct"] == 3
        )
        assert mfu_gate["baseline_span_h"] < 1 and "baseline_min_span_h = 24 h" in mfu_gate["reason"]
        for run in slow["runs"]:  # the first run and its confirmation, each judged on the widened line
            mfu = next(r for r in run["comparison"] if r["metric"] == keys.MFU_ADJ)
            assert mfu["fail"] == pytest.approx(mfu_gate["fail_pct"]) and mfu["level"] in ("warn", "fail")
        decision = next(d for d in slow["decision"] if d["metric"] == keys.MFU_ADJ)
        assert decision["final"] == "fail" and decision["pooled_delta"] < -mfu_gate["fail_pct"]
        assert slow["notice"].startswith("young baseline: ")
        assert "- MFU gate: the 3 baseline entries span" in (tmp_path / "slow" / "canary.md").read_text()


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.unpaired  # its baseline entries are separate runs: a neighbour skews them
def test_reports_carry_the_profile_summary(recorded: Path) -> None:
    rep = json.loads((recorded / "rep-record" / "canary.json").read_text())
    prof = rep["profile"]
    assert prof["file"] and prof["profiled_steps"] >= 1
    ops = [r["op"] for r in prof["top_total"]]
    assert ops and all(r["total_ms"] >= r["self_ms"] >= 0 for r in prof["top_total"])
    assert any(op.startswith("aten::") for op in [r["op"] for r in prof["top_self"]])
    md = (recorded / "rep-record" / "canary.md").read_text()
    assert "Top ops by total time" in md and "Top ops by self time" in md and "`aten::" in md
    assert "## Environment vs baseline" in md


# ---- usage errors (exit 2) ---------------------------------------------------------------------
def test_usage_errors(tmp_path: Path) -> None:
    h = ["--history", str(tmp_path / "h.jsonl"), "--runs", str(tmp_path / "runs")]
    assert main(["canary", "--runs", str(tmp_path / "runs")]) == 2  # no --history
    assert main(["canary", *h, "--record", "--inject", "slow:10"]) == 2
    assert main(["canary", *h, "--inject", "fast:10"]) == 2
    assert main(["canary", *h, "--set", "canary.mfu_fail_pct=1", "--set", "canary.mfu_warn_pct=2"]) == 2
    assert main(["canary", *h, "--set", "canary.nope=1"]) == 2
    assert main(["canary", *h, "--matrix", "colour=red"]) == 2
    assert main(["canary", *h, "--accept"]) == 2
    assert not (tmp_path / "runs").exists()


# ---- the pieces, without training ---------------------------------------------------------------
def _entry(
    mfu: float, *, fp: str = "hw | cfg abc", h: str = "abc", baseline: bool = True, **kw: object
) -> dict:
    return {
        "fingerprint": fp,
        "config_hash": h,
        "baseline": baseline,
        "mfu_p50": mfu,
        "mfu_host_adj_p50": mfu,
        "tokens_per_s_p50": 1000.0,
        "mem_peak_bytes": 1e9,
        "data_wait_share": 0.01,
        "final_loss": 2.0,
        **kw,
    }


def test_compare_levels_against_the_median() -> None:
    c = config.CanaryConfig(mfu_warn_pct=3, mfu_fail_pct=5)
    base = [_entry(0.20), _entry(0.21), _entry(0.19), _entry(0.50)]  # median 0.205; one outlier
    for timing, key in (("cpu", keys.MFU_ADJ), ("wall", keys.MFU)):  # CPU gates the host-adjusted MFU
        rows = {r["metric"]: r for r in gate.compare(_entry(0.200), base, c, timing)}
        assert rows[key]["baseline"] == pytest.approx(0.205) and rows[key]["level"] == "pass"
        assert {r["metric"]: r for r in gate.compare(_entry(0.197), base, c, timing)}[key]["level"] == "warn"
        assert {r["metric"]: r for r in gate.compare(_entry(0.190), base, c, timing)}[key]["level"] == "fail"
        assert {r["metric"]: r for r in gate.compare(_entry(0.300), base, c, timing)}[key]["level"] == "pass"
    worse = _entry(0.205, final_loss=2.2, mem_peak_bytes=1.3e9, data_wait_share=0.2)
    rows = {r["metric"]: r for r in gate.compare(worse, base, c, "cpu")}
    assert rows["final_loss"]["level"] == "fail" and rows["mem_peak_bytes"]["level"] == "fail"
    assert rows["data_wait_share"]["level"] == "fail" and rows["data_wait_share"]["delta"] == pytest.approx(
        19
    )
    assert gate.worst(["pass", "warn", "pass"]) == "warn" and gate.worst([]) == "pass"


def test_baseline_selection_and_history_parsing(tmp_path: Path) -> None:
    p = tmp_path / "h.jsonl"
    entries = [_entry(0.1 + i / 100) for i in range(12)]
    entries += [_entry(0.9, fp="other | cfg abc"), _entry(0.9, h="zzz"), _entry(0.9, baseline=False)]
    p.write_text("\n".join(json.dumps(e) for e in entries) + '\nnot json\n{"x": 1}\n\n')
    got, problems = history.read_history(p)
    assert len(got) == 15 and problems == ["line 16: not JSON", "line 17: not a canary entry"]
    sel = history.select_baseline(got, "hw | cfg abc", "abc", 10)
    assert [e["mfu_p50"] for e in sel] == pytest.approx([0.1 + i / 100 for i in range(2, 12)])
    assert history.select_baseline(got, "new hw | cfg abc", "abc", 10) == []
    assert history.read_history(tmp_path / "missing.jsonl") == ([], [])


def test_parse_slow_and_matrix() -> None:
    assert (
        config.parse_slow([]) == 0
        and config.parse_slow(["slow:7.5"]) == 7.5
        and config.parse_slow(["slow:5%"]) == 5
    )
    for bad in ("slow", "slow:x", "slow:0", "gradspike@3:2"):
        with pytest.raises(ConfigError):
            config.parse_slow([bad])
    v = matrix.parse_matrix(["attention=math,flash", "experts=loop,bmm,grouped_mm", "compile=off,on"])
    assert len(v) == 12
    assert v[0] == (
        "attention=math experts=loop compile=off",
        {"model.attention": "math", "model.experts_kernel": "loop", "train.compile": False},
    )
    assert v[-1][1]["train.compile"] is True
    assert matrix.parse_matrix(["model.top_k=1,2"])[1] == ("model.top_k=2", {"model.top_k": 2})
    for bad in ("attention", "colour=red", "compile=maybe"):
        with pytest.raises(ConfigError):
            matrix.parse_matrix([bad])


def test_profile_summary_self_time_from_a_chrome_trace(tmp_path: Path) -> None:
    events = [
        {
            "ph": "X",
            "cat": "user_annotation",
            "name": "ProfilerStep#7",
            "pid": 1,
            "tid": 1,
            "ts": 0,
            "dur": 100,
        },
        {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "pid": 1, "tid": 1, "ts": 0, "dur": 50},
        {"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "pid": 1, "tid": 1, "ts": 5, "dur": 40},
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "pid": 1, "tid": 1, "ts": 10, "dur": 10},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1, "ts": 60, "dur": 35},
        {"ph": "X", "cat": "kernel", "name": "gemm_kernel", "pid": 0, "tid": 7, "ts": 6, "dur": 20},
        {"ph": "i", "cat": "cpu_op", "name": "ignored", "pid": 1, "tid": 1, "ts": 1},
    ]
    (tmp_path / "profile").mkdir()
    (tmp_path / "profile" / "host.pt.trace.json").write_text(json.dumps({"traceEvents": events}))
    s = profile.profile_summary(tmp_path)
    assert s["profiled_steps"] == 1
    total = {r["op"]: r for r in s["top_total"]}
    assert total["aten::linear"]["total_ms"] == pytest.approx(0.050)
    assert total["aten::linear"]["self_ms"] == pytest.approx(0.010)  # 50 - addmm 40
    assert total["aten::addmm"]["self_ms"] == pytest.approx(0.030)  # 40 - copy_ 10
    assert [r["op"] for r in s["top_self"][:2]] == ["aten::add", "aten::addmm"]  # 35 us, 30 us self
    assert s["device_top"][0]["op"] == "gemm_kernel"
    assert profile.profile_summary(tmp_path / "nowhere")["file"] is None


def test_env_differences_name_what_changed() -> None:
    base = [
        _entry(0.2, env={"torch": "2.12.0", "expert_kernel": "bmm"}),
        _entry(0.2, env={"torch": "2.12.0", "expert_kernel": "bmm"}),
    ]
    diff = report.env_differences({"torch": "2.13.0", "expert_kernel": "bmm"}, base)
    assert [d["key"] for d in diff if d["key"] in ("torch", "expert_kernel")] == ["torch"]
    assert diff[0]["baseline"] == {"2.12.0": 2}


def _rows(**levels: tuple[str, float]) -> list[dict]:
    return [{"metric": m, "label": m, "level": lv, "delta": d} for m, (lv, d) in levels.items()]


def test_a_regression_must_repeat() -> None:
    first = _rows(mfu_p50=("fail", -6.0), final_loss=("pass", 0.0))
    assert gate.needs_confirmation(first)
    assert gate.needs_confirmation(_rows(mfu_p50=("warn", -3.0)))  # MFU past its warn line: re-run
    assert gate.needs_confirmation(_rows(mfu_host_adj_p50=("warn", -3.0)))
    assert not gate.needs_confirmation(_rows(mfu_p50=("pass", -1.0), final_loss=("warn", 3.0)))
    # Repeated: the mean of both runs fails and the re-run alone is at least a warn -> fail.
    d = gate.decide(
        [first, _rows(mfu_p50=("warn", -3.5), final_loss=("pass", 0.0))],
        _rows(mfu_p50=("fail", -4.8), final_loss=("pass", 0.0)),
    )
    assert [x["final"] for x in d] == ["fail", "pass"] and d[0]["pooled_delta"] == -4.8
    # Not repeated: the re-run passes -> warn, even though the mean is still past the fail line.
    d = gate.decide(
        [first, _rows(mfu_p50=("pass", -1.0), final_loss=("pass", 0.0))],
        _rows(mfu_p50=("fail", -3.5), final_loss=("pass", 0.0)),
    )
    assert d[0]["final"] == "warn"
    # One run only: its own levels.
    assert [x["final"] for x in gate.decide([first], [])] == ["fail", "pass"]
    pooled = stats.pool_summaries([{"mfu_p50": 0.2, "final_loss": 2.0}, {"mfu_p50": 0.3, "final_loss": 2.0}])
    assert pooled["mfu_p50"] == pytest.approx(0.25)


def test_processes_pool_by_median_and_keep_each_processs_mfu() -> None:
    def one(mfu: float, mem: int) -> dict:
        return {
            keys.MFU: mfu,
            keys.TPS: 1000 * mfu,
            keys.MEM: mem,
            keys.DATA_WAIT: 0.01,
            keys.LOSS: 2.0,
            keys.REF: 7.0,
            "window_steps": 160,
            "steps": 200,
        }

    pooled = stats.pool_processes([one(0.20, 5), one(0.10, 9), one(0.21, 7)])  # one odd, slow process
    assert pooled[keys.MFU] == pytest.approx(0.20) and pooled[keys.TPS] == pytest.approx(200)
    assert pooled[keys.MEM] == 9 and pooled["window_steps"] == 480 and pooled["steps"] == 600
    assert pooled["process_mfu"] == [0.20, 0.10, 0.21] and pooled["process_ref_ms"] == [7.0, 7.0, 7.0]
    assert stats.pool_processes([one(0.3, 1)])["process_mfu"] == [0.3]
    # Two confirmed runs: the gate metrics are averaged, the processes of both kept for the history.
    a, b = stats.pool_processes([one(0.2, 1)] * 2), stats.pool_processes([one(0.1, 1)] * 3)
    both = stats.pool_summaries([a, b])
    assert both[keys.MFU] == pytest.approx(0.15) and both["process_mfu"] == [0.2, 0.2, 0.1, 0.1, 0.1]


# ---- the host adjustment ------------------------------------------------------------------------
def _host(refs: list[float], b: float, level: float = 0.2) -> list[tuple[float, float]]:
    """(MFU, ref ms) of processes whose step time goes as ref**b: MFU = level * (ref / 10) ** (1 - b)."""
    return [(level * (r / 10.0) ** (1 - b), r) for r in refs]


SLOW_PHASES = [9.5, 9.8, 10.0, 10.1, 10.3, 10.6, 10.9, 11.2, 9.7, 10.0, 10.4, 10.8]  # ref ms, +-9%


def test_host_fit_removes_the_hosts_slow_phases_but_not_a_regression() -> None:
    fit = gate.fit_host(_host(SLOW_PHASES, b=3.0))
    assert fit.n == 12 and fit.slope == pytest.approx(-2.0, abs=0.05) and fit.r == pytest.approx(-1.0)
    # Plain normalisation reads the host's slow phase (ref 11 ms) as -17%; adjusted it is level.
    ((plain, ref),) = _host([11.0], b=3.0)
    assert plain / 0.2 - 1 < -0.15
    assert fit.adjust(plain, ref) == pytest.approx(fit.adjust(*_host([10.0], b=3.0)[0]), rel=0.01)
    # A 5% regression at the same host speed stays a 5% drop after the adjustment.
    assert fit.adjust(0.95 * plain, ref) / fit.adjust(plain, ref) == pytest.approx(0.95)
    # Baseline and current go through the same fit: with_host_adjusted takes each entry's processes.
    base = [
        gate.with_host_adjusted({keys.MFU: 0.2, keys.PROC_MFU: [m], keys.PROC_REF: [r]}, fit)
        for m, r in _host(SLOW_PHASES, b=3.0)
    ]
    assert max(e[keys.MFU_ADJ] for e in base) / min(e[keys.MFU_ADJ] for e in base) < 1.01


def test_a_young_baseline_widens_the_mfu_fail_line() -> None:
    def entries(*times: str, mfu: tuple[float, ...] = (0.20, 0.21, 0.205)) -> list[dict[str, object]]:
        return [{"time": t, keys.MFU: m, keys.MFU_ADJ: m} for t, m in zip(times, mfu, strict=False)]

    c = config.CanaryConfig(mfu_warn_pct=2, mfu_fail_pct=3, baseline_min_span_h=24)
    day = entries("2026-11-22T10:00:00Z", "2026-11-22T22:00:00Z", "2026-11-23T10:30:00Z")
    assert history.baseline_span_h(day) == pytest.approx(24.5)
    assert history.baseline_span_h(entries("2026-11-22T10:00:00Z")) == 0
    assert (
        history.baseline_span_h(entries("garbage", "2026-11-22T10:00:00Z")) == 0
    )  # unreadable times are skipped
    line = gate.young_fail_line(day, config.TIMING_CPU, c)  # spans a day: the configured line
    assert line["fail_pct"] == 3 and not line["widened"] and line["reason"] == ""
    # One sitting, spread (0.21 - 0.20) / 0.205 = 4.9%: 3 x 4.9 = 14.6% (above the 10% floor).
    sitting = entries("2026-11-23T10:00:00Z", "2026-11-23T10:03:00Z", "2026-11-23T10:06:00Z")
    line = gate.young_fail_line(sitting, config.TIMING_CPU, c)
    assert line["widened"] and line["fail_pct"] == pytest.approx(3 * 100 * 0.01 / 0.205)
    assert line["spread_pct"] == pytest.approx(100 * 0.01 / 0.205)
    assert "span 0.1 h" in line["reason"] and "baseline_min_span_h = 24 h" in line["reason"]
    # A tight baseline: the floor; a wild one: the cap (a 30% slowdown, -23% MFU, still fails).
    tight = entries(*[f"2026-11-23T10:0{i}:00Z" for i in range(3)], mfu=(0.200, 0.201, 0.2005))
    assert gate.young_fail_line(tight, config.TIMING_CPU, c)["fail_pct"] == 10
    wild = entries(*[f"2026-11-23T10:0{i}:00Z" for i in range(3)], mfu=(0.18, 0.22, 0.20))
    assert gate.young_fail_line(wild, config.TIMING_CPU, c)["fail_pct"] == 20
    # One entry: its worker processes' spread.
    one = [
        {
            "time": "2026-11-23T10:00:00Z",
            keys.MFU_ADJ: 0.2,
            keys.PROC_MFU: [0.19, 0.21, 0.2],
            keys.PROC_REF: [5.0, 5.0, 5.0],
        }
    ]
    assert gate.young_fail_line(one, config.TIMING_CPU, c)["spread_pct"] == pytest.approx(10)
    # Configured lines wider than the widening stay; the rule is off on GPUs (wall clock) and at 0 h.
    assert (
        gate.young_fail_line(
            sitting,
            config.TIMING_CPU,
            config.CanaryConfig(mfu_warn_pct=20, mfu_fail_pct=25, baseline_min_span_h=24),
        )["fail_pct"]
        == 25
    )
    assert not gate.young_fail_line(sitting, config.TIMING_WALL, c)["widened"]
    assert not gate.young_fail_line(sitting, config.TIMING_CPU, config.CanaryConfig(baseline_min_span_h=0))[
        "widened"
    ]
    with pytest.raises(ConfigError):
        config.CanaryConfig(young_fail_floor_pct=30, young_fail_cap_pct=20)


def test_host_fit_does_not_extrapolate_or_overfit() -> None:
    fit = gate.fit_host(_host(SLOW_PHASES, b=3.0))
    # A host far slower than any baseline process is corrected only up to the slowest one seen.
    ((far, ref),) = _host([14.0], b=3.0)
    edge = fit.adjust(*_host([max(SLOW_PHASES)], b=3.0)[0])
    assert fit.adjust(far, ref) == pytest.approx(edge * far / _host([max(SLOW_PHASES)], b=3.0)[0][0])
    # A baseline that saw (almost) no host variation: the slope shrinks towards plain normalisation.
    quiet = gate.fit_host(_host([10.0 + 0.01 * (i % 3) for i in range(12)], b=3.0))
    assert abs(quiet.slope) < 0.1
    # Too few processes: no fit, MFU unchanged; entries without per-process pairs keep their MFU.
    few = gate.fit_host(_host(SLOW_PHASES[:5], b=3.0))
    assert few.n == 0 and few.adjust(0.2, 12.0) == 0.2
    assert gate.with_host_adjusted({keys.MFU: 0.3}, fit)[keys.MFU_ADJ] == 0.3
    # The slope is clamped: a wild fit cannot blow the correction up.
    wild = gate.fit_host(_host(SLOW_PHASES, b=40.0))
    assert wild.slope == gate.HOST_FIT_SLOPE_RANGE[0]


def test_power_bench_judges_against_every_other_clean_measurement() -> None:
    """bench/canary/canary_power.py's leave-one-out judgement: a clean run never sits in its own baseline,
    injected runs never enter one, and the gate's rule (warn line, then mean of both runs) applies."""
    from bench.canary.canary_power import spanning

    def rep(*runs: tuple[float, float]) -> dict[str, object]:
        # each run: 5 processes at (MFU, reference ms); MFU/ref spread a little so the fit has data
        return {
            "runs": [
                {
                    "summary": {
                        keys.PROC_MFU: [m * (1 + 0.002 * i) for i in range(5)],
                        keys.PROC_REF: [r * (1 + 0.01 * i) for i in range(5)],
                    }
                }
                for m, r in runs
            ]
        }

    clean = [rep((0.25 * (1 + 0.003 * (i % 3 - 1)), 4.6)) for i in range(6)]
    outlier = rep((0.235, 4.6), (0.236, 4.6))  # a clean measurement 6% low, re-run low too
    slow5 = [rep((0.2375, 4.6), (0.2375, 4.6)) for _ in range(3)]
    slow1 = [rep((0.2475, 4.6)) for _ in range(2)]  # -1%: never past a 2% warn line, never re-run
    res = spanning({"clean": [*clean, outlier], "5%": slow5, "1%": slow1}, [], [(2.0, 3.0), (2.0, 7.0)])
    row = {r["fail"]: r for r in res["table"]}
    # The outlier is judged against the six normal runs (not itself): it fails at -2/-3, not at -2/-7.
    assert row[3.0]["clean"] == "1/7" and row[7.0]["clean"] == "0/7"
    # The injected runs are judged against all seven clean ones and never join the pool.
    assert row[3.0]["5%"] == "3/3" and row[7.0]["5%"] == "0/3" and row[3.0]["1%"] == "0/2"
    assert -5.5 < sum(res["first_deltas"]["5%"]) / 3 < -4.5
    # A run past the warn line that was never re-run cannot be judged: counted, not guessed.
    res = spanning({"clean": clean, "5%": [rep((0.2375, 4.6))]}, [], [(2.0, 3.0)])
    assert res["table"][0]["5%"] == "0/1 (1 unjudged)"
