"""`moeguard canary --ab A B`: environments, ABBA order, the paired statistic, real A/B runs.

The end-to-end tests run real worker processes (the history canary's worker) on the shipped canary
model run short (test_canary.SHORT), with a loose line (10%) and a large injected slowdown (40%,
B/A ~0.71) so the verdicts are unambiguous on a loaded or idle 2-core machine. bench/canary/canary_power.py --ab measures the
real defaults' power. The runs whose verdict is a measured ratio (B slowed fails, A = A passes, the
slowed matrix cell) are `serial`: scripts/test runs them alone, after the parallel phase.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from guard.canary import ab, ab_format, config, matrix
from guard.cli import main
from guard.core.tomlconf import ConfigError
from tests.guard.test_canary import SHORT, _sets
from trainer.canary_cli import TRAINER
from trainer.cli import parse_overrides

AB_SHORT = [*SHORT, "canary.ab_fail_pct=10"]


def _ab(tmp: Path, a: str, b: str, *extra: str, pairs: int, report: str = "rep") -> tuple[int, dict]:
    code = main(
        [
            "canary",
            "--ab",
            a,
            b,
            "--runs",
            str(tmp / "runs"),
            "--report-dir",
            str(tmp / report),
            *_sets([*AB_SHORT, f"canary.ab_pairs={pairs}", f"canary.ab_max_pairs={pairs}"]),
            *extra,
        ]
    )
    path = tmp / report / "ab.json"
    return code, (json.loads(path.read_text()) if path.is_file() else {})


# ---- real A/B runs ------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.serial(cost=46)
def test_ab_with_b_slowed_fails_on_the_paired_ratio(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, rep = _ab(
        tmp_path, "set:", "set:model.experts_kernel=bmm,train.seed=0", "--inject", "slow:40", pairs=4
    )
    assert code == 1 and rep["verdict"] == "fail" and rep["exit_code"] == 1
    # ABBA: pairs alternate AB, BA; the workers ran in exactly that order, one A and one B per pair.
    assert rep["sequence"] == "ABBAABBA"
    assert [w["side"] for w in rep["workers"]] == list("ABBAABBA")
    assert [w["pair"] for w in rep["workers"]] == [1, 1, 2, 2, 3, 3, 4, 4]
    # Every worker is a real run in the run store, marked with its side; only B was slowed.
    for w in rep["workers"]:
        run_dir = Path(w["run_dir"])
        meta = json.loads((run_dir / "meta.json").read_text())
        assert meta["status"] == "finished" and meta["canary"]["variant"].startswith(f"ab {w['side']}: ")
        assert meta["canary"]["slow_pct"] == (40 if w["side"] == "B" else 0)
    # The paired statistic: per-pair B/A of the workers' own speeds, their median, the interval.
    by_run = {w["run_id"]: w for w in rep["workers"]}
    ratios = [p["ratio"]["speed"] for p in rep["pairs"]]
    for p, r in zip(rep["pairs"], ratios, strict=True):
        assert r == pytest.approx(by_run[p["b_run"]]["speed"] / by_run[p["a_run"]]["speed"])
        assert r < 0.9  # 40% more CPU per step: ~0.71
    st = rep["statistic"]
    assert st["median"] == pytest.approx(sorted(ratios)[1] / 2 + sorted(ratios)[2] / 2)
    # slow:40 burns 40% of the previous step's CPU time: ~0.71 (at ~3 ms steps the burn loop's
    # clock_gettime calls slowed the steps around it too, to 0.5).
    assert 0.4 < st["median"] < 0.85 and st["n_pairs"] == 4
    assert st["ci"] == pytest.approx([min(ratios), max(ratios)])  # n = 4: the sign-test interval is the range
    assert st["coverage"] == pytest.approx(1 - 2 / 16) and st["ci"][1] < st["fail_below"] == pytest.approx(
        0.9
    )
    assert rep["sides"]["B"]["slow_pct"] == 40 and rep["sides"]["A"]["slow_pct"] == 0
    # The environment diff names what differs (the override set) and what does not (torch, kernel).
    diff = {d["key"]: d for d in rep["env_diff"]}
    assert (
        diff["overrides"]["differs"] and not diff["torch"]["differs"] and not diff["expert_kernel"]["differs"]
    )
    assert diff["attention_backend"]["a"] not in ("?", "None")  # the backend actually used, from the worker
    assert rep["profile_diff"]["workers_profiled"] == {"A": 4, "B": 4} and rep["profile_diff"]["host"]
    md = (tmp_path / "rep" / "ab.md").read_text()
    assert md.startswith("# A/B canary: FAIL") and "## Pairs" in md and "## Environments" in md
    assert "Host ops, self time per step" in md
    assert "canary A/B FAIL" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.serial(cost=34)
def test_a_equals_a_passes_and_a_py_interpreter_runs_the_worker(tmp_path: Path) -> None:
    """A = this interpreter, B = the same interpreter given as py:PATH: no change, so no fail; the
    py: side runs its worker through that interpreter and reports it."""
    code, rep = _ab(tmp_path, "set:", f"py:{sys.executable}", pairs=3)
    assert code == 0 and rep["verdict"] in ("pass", "warn"), rep.get("state")
    assert rep["sequence"] == "ABBAAB" and rep["statistic"]["n_pairs"] == 3
    assert 0.85 < rep["statistic"]["median"] < 1.15
    assert rep["sides"]["B"]["python"] == str(Path(sys.executable).absolute())
    diff = {d["key"]: d for d in rep["env_diff"]}
    assert not diff["torch"]["differs"] and not diff["python"]["differs"] and not diff["moeguard"]["differs"]
    assert diff["python_executable"]["b"] == sys.executable
    assert "mfu" in rep["other_ratios"]  # same FLOPs per token on both sides: the MFU ratio is shown


# ---- the kernel matrix runs through the A/B runner -----------------------------------------------
def _matrix(tmp: Path, *axes: str, pairs: int, extra: tuple[str, ...] = ()) -> tuple[int, dict]:
    code = main(
        [
            "canary",
            "--matrix",
            *axes,
            "--repeats",
            str(pairs),
            "--runs",
            str(tmp / "runs"),
            "--report-dir",
            str(tmp / "rep"),
            *_sets(AB_SHORT),
            *extra,
        ]
    )
    path = tmp / "rep" / "matrix.json"
    return code, (json.loads(path.read_text()) if path.is_file() else {})


@pytest.mark.slow
@pytest.mark.serial(cost=22)
def test_a_two_cell_matrix_is_an_ab_canary_of_the_cell_against_the_reference(tmp_path: Path) -> None:
    """experts=loop,bmm: the reference (loop) and one cell (bmm, slowed 40% by --inject) measured as
    `--ab set:model.experts_kernel=loop set:model.experts_kernel=bmm`: ABBA worker pairs, the paired
    statistic, the cell's own ab.json; a slower cell is information, not a failure (exit 0)."""
    code, rep = _matrix(tmp_path, "experts=loop,bmm", pairs=2, extra=("--inject", "slow:40"))
    assert code == 0, rep
    ref, cell = rep["cells"]
    assert (
        ref["cell"] == "experts=loop" and ref["status"] == "reference" and rep["reference"] == "experts=loop"
    )
    assert cell["cell"] == "experts=bmm" and cell["status"] == "ok" and cell["n_pairs"] == 2
    assert cell["judged"] == "slower" and cell["ratio_median"] < 0.85 and cell["ci"][1] < 1
    # what each side actually ran, from its workers
    assert (ref["expert_kernel"], cell["expert_kernel"]) == ("loop", "bmm")
    assert not rep["not_fastest"]  # the slowed cell is not faster than the reference
    # The cell's report is an A/B report in ab.json's one format, read back by its one reader.
    ab_rep = ab_format.read_report(Path(cell["ab_report"]))
    assert ab_rep["sequence"] == "ABBA" and [w["side"] for w in ab_rep["workers"]] == list("ABBA")
    assert ab_rep["sides"]["A"]["spec"] == "set:model.experts_kernel=loop"
    assert (
        ab_rep["sides"]["B"]["spec"] == "set:model.experts_kernel=bmm"
        and ab_rep["sides"]["B"]["slow_pct"] == 40
    )
    assert ab_rep["statistic"]["median"] == pytest.approx(cell["ratio_median"])
    assert ab_rep["verdict"] == "fail"  # 40% slower than the reference, past ab_fail_pct = 10
    diff = {d["key"]: d for d in ab_rep["env_diff"]}
    assert diff["expert_kernel"]["differs"] and (diff["expert_kernel"]["a"], diff["expert_kernel"]["b"]) == (
        "loop",
        "bmm",
    )
    assert set(ref["runs"]) == set(ab_rep["sides"]["A"]["run_ids"])  # the reference's workers are real runs
    for rid in ref["runs"] + cell["runs"]:
        assert (
            tmp_path / "runs" / ab_format.WORKER_RUNS_DIR / rid / "meta.json"
        ).is_file()  # apart from the user's
    md = (tmp_path / "rep" / "matrix.md").read_text()
    assert md.startswith("# Canary kernel matrix") and "| experts=bmm | " in md and "slower" in md


@pytest.mark.slow
def test_matrix_lists_a_cell_that_cannot_run_here_as_unavailable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("cudnn attention can run here")
    # Seeded random order, seed 0: the first pair runs B (the cudnn cell) first, so it is found
    # unavailable at its worker's start-up without a whole reference worker measured and thrown away
    # first (ABBA's first pair is AB); which side runs first is not what this test is about.
    order = ("--set", "canary.ab_order=random", "--set", "canary.ab_seed=0")
    code, rep = _matrix(tmp_path, "attention=math,cudnn", pairs=2, extra=order)
    assert code == 0  # a kernel this machine lacks is not an error
    by = {r["cell"]: r for r in rep["cells"]}
    assert by["attention=math"]["status"] == "reference"
    assert by["attention=cudnn"]["status"] == "unavailable" and "cudnn" in by["attention=cudnn"]["reason"]
    assert "unavailable" in capsys.readouterr().err


def test_ab_json_reader_names_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(ab_format.ReportError, match="not an A/B canary report"):
        ab_format.parse_report({"kind": "matrix"})
    with pytest.raises(ab_format.ReportError, match="newer than this reader"):
        ab_format.parse_report({"kind": "ab", "format": ab_format.FORMAT + 1})
    with pytest.raises(ab_format.ReportError, match="key 'verdict' is missing"):
        ab_format.parse_report({"kind": "ab"})
    bad = tmp_path / "ab.json"
    bad.write_text("{not json")
    with pytest.raises(ab_format.ReportError, match=f"{bad}: cannot read it as JSON"):
        ab_format.read_report(bad)


def test_matrix_ranks_cells_and_says_when_the_reference_is_not_the_fastest(tmp_path: Path) -> None:
    """Judged by each cell's interval: a cell whose interval lies above 1 is faster than the
    reference, and the report says the reference is not the fastest; one whose interval holds 1 is
    no clear difference. Cell reports written by the canary's own writer."""
    from tests.dashboards.synth_ab import write_ab_report

    cells = matrix.parse_matrix(["experts=bmm,loop,grouped_mm"])
    reports = {
        "experts=loop": ab_format.read_report(write_ab_report(tmp_path / "loop", [1.15, 1.2, 1.18, 1.21])),
        "experts=grouped_mm": ab_format.read_report(
            write_ab_report(tmp_path / "gmm", [0.99, 1.02, 1.0, 0.98])
        ),
    }
    setup = config.load_setup(config.DEFAULT_CONFIG, {}, TRAINER)
    rep = matrix.matrix_report(setup, cells, reports, {}, tmp_path)
    by = {r["cell"]: r for r in rep["cells"]}
    assert by["experts=bmm"]["judged"] == "reference" and by["experts=loop"]["judged"] == "faster"
    assert by["experts=grouped_mm"]["judged"] == "no clear difference"
    assert rep["not_fastest"].startswith(
        "The reference (experts=bmm) is not the fastest: experts=loop is faster"
    )
    table = matrix.render_matrix_table(rep).splitlines()[2:]
    assert [row.split(" | ")[0].strip("| ") for row in table] == [
        "experts=loop",
        "experts=bmm",
        "experts=grouped_mm",
    ]
    slower = {
        "experts=loop": ab_format.read_report(write_ab_report(tmp_path / "slow", [0.9, 0.92, 0.91, 0.9]))
    }
    assert matrix.matrix_report(setup, cells[:2], slower, {}, tmp_path)["not_fastest"] == ""


def test_matrix_cells_are_set_environments() -> None:
    cells = matrix.parse_matrix(["experts=loop,bmm", "compile=off,on"])
    assert [matrix.set_spec(ov) for _, ov in cells[:2]] == [
        "set:model.experts_kernel=loop,train.compile=false",
        "set:model.experts_kernel=loop,train.compile=true",
    ]
    side = ab.parse_side(
        matrix.set_spec(cells[3][1]), "B", parse_overrides
    )  # round-trips through --ab's parser
    assert side.overrides == cells[3][1] == {"model.experts_kernel": "bmm", "train.compile": True}


# ---- usage errors name the bad value ------------------------------------------------------------
@pytest.mark.parametrize(
    ("a", "b", "says"),
    [
        ("torch=2.13", "set:", "'torch=2.13': expected py:PATH"),
        ("set:", "py:", "py: needs the path of a Python interpreter"),
        ("set:", "py:/no/such/python", "'/no/such/python' is not an executable file"),
        ("set:model.attention", "set:", "'model.attention' is not KEY=VALUE"),
        ("set:", "set:model.nope=1", "--ab B = 'set:model.nope=1': "),
        ("set:canary.warmup_steps=5", "set:", "canary.warmup_steps is a measurement setting"),
    ],
)
def test_bad_ab_specs_are_usage_errors_naming_the_value(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], a: str, b: str, says: str
) -> None:
    assert main(["canary", "--ab", a, b, "--runs", str(tmp_path / "runs")]) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_ab_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = ["--runs", str(tmp_path / "runs")]
    assert main(["canary", "--ab", "set:", "set:", "--history", str(tmp_path / "h.jsonl"), *runs]) == 2
    assert "drop --history" in capsys.readouterr().err
    assert main(["canary", "--ab", "set:", "set:", "--record", *runs]) == 2
    assert main(["canary", "--ab", "set:", "set:", "--inject", "c:slow:5", *runs]) == 2
    assert main(["canary", "--ab", "set:", "set:", "--set", "canary.ab_order=zigzag", *runs]) == 2
    assert (
        main(["canary", "--ab", "set:", "set:", "--set", "canary.ab_max_pairs=2", *runs]) == 2
    )  # < ab_pairs
    capsys.readouterr()
    assert main(["canary", "--matrix", "experts=loop", *runs]) == 2  # one cell: nothing to pair it with
    assert "a matrix needs two values" in capsys.readouterr().err
    assert main(["canary", "--matrix", "experts=loop,bmm", "--repeats", "1", *runs]) == 2
    assert "--repeats 1: a cell needs at least 2 pairs" in capsys.readouterr().err
    not_python = tmp_path / "not-python"
    not_python.write_text("#!/bin/sh\nexit 3\n")
    not_python.chmod(0o755)
    capsys.readouterr()
    assert main(["canary", "--ab", "set:", f"py:{not_python}", *runs]) == 2
    assert "not a working Python interpreter" in capsys.readouterr().err


# ---- the pieces ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("worker_module", "expected"),
    [
        ("trainer/canary_worker.py", ("-m", "trainer.canary_worker")),
        (None, ("-m", "guard.canary", "--worker")),  # an install from before guard/canary/ was a package
    ],
)
def test_a_py_interpreter_with_its_own_moeguard_runs_its_own_worker(
    tmp_path: Path, worker_module: str | None, expected: tuple[str, ...]
) -> None:
    install = tmp_path / "site"
    for pkg in ("guard", "trainer"):
        (install / pkg).mkdir(parents=True)
        (install / pkg / "__init__.py").write_text("")
    if worker_module:
        (install / worker_module).write_text("")
    python = tmp_path / "python"  # that venv's interpreter: this one, seeing only its own install
    python.write_text(f'#!/bin/sh\nPYTHONPATH={install} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    side = ab.parse_side(f"py:{python}", "B", parse_overrides)
    ab.probe_interpreter(side, tmp_path)
    assert side.probe["moeguard"] == f"its own install ({install})" and side.worker == expected
    assert "PYTHONPATH" not in side.extra_env


def test_parse_side_and_inject() -> None:
    s = ab.parse_side("set:model.attention=math,train.compile=true, model.top_k=1", "B", parse_overrides)
    assert s.python is None and s.overrides == {
        "model.attention": "math",
        "train.compile": True,
        "model.top_k": 1,
    }
    assert ab.parse_side("set:", "A", parse_overrides).overrides == {}
    p = ab.parse_side(f"py:{sys.executable}", "A", parse_overrides)
    assert p.python == str(Path(sys.executable).absolute()) and p.overrides == {}  # a venv symlink is kept
    assert ab.parse_inject([]) == (0.0, 0.0)
    assert ab.parse_inject(["slow:5"]) == (0.0, 5.0)  # plain slow: B
    assert ab.parse_inject(["a:slow:3", "B:slow:7"]) == (3.0, 7.0)
    with pytest.raises(ConfigError):
        ab.parse_inject(["b:fast:3"])


def test_abba_and_seeded_random_orders() -> None:
    assert ab.pair_orders(5, "abba", random.Random(0)) == ["AB", "BA", "AB", "BA", "AB"]
    assert ab.pair_orders(2, "abba", random.Random(0), start=5) == ["BA", "AB"]  # continues the blocks
    one = ab.pair_orders(40, "random", random.Random(7))
    assert one == ab.pair_orders(40, "random", random.Random(7))  # seeded: reproducible
    assert set(one) == {"AB", "BA"} and 10 < one.count("AB") < 30


def test_sign_test_interval_coverage() -> None:
    xs = [0.90, 0.95, 0.97, 0.98, 0.99, 1.00, 1.01, 1.02, 1.03, 1.05, 1.06, 1.10]
    lo, hi, cov = ab.sign_test_interval(xs[:6], 0.95)  # n = 6: only the range reaches 95%
    assert (lo, hi) == (0.90, 1.00) and cov == pytest.approx(1 - 2 / 64)
    lo, hi, cov = ab.sign_test_interval(xs[:10], 0.95)  # n = 10: [x(2), x(9)], 97.9%
    assert (lo, hi) == (0.95, 1.03) and cov == pytest.approx(1 - 2 * 11 / 1024)
    lo, hi, cov = ab.sign_test_interval(list(reversed(xs)), 0.95)  # n = 12: [x(3), x(10)], 96.1%
    assert (lo, hi) == (0.97, 1.05) and cov == pytest.approx(1 - 2 * 79 / 4096)
    assert ab.sign_test_interval([1.0, 2.0], 0.95)[2] == pytest.approx(0.5)  # too few: the range, said so


def test_paired_verdicts() -> None:
    c = config.CanaryConfig(ab_fail_pct=2.0, ab_confidence=0.95)

    def verdict(*xs: float) -> tuple[str, bool]:
        s = ab.paired_statistic(list(xs), c)
        return s["verdict"], s["undecided"]

    assert verdict(0.95, 0.96, 0.94, 0.97, 0.95, 0.96) == ("fail", False)  # all below 0.98
    assert verdict(0.95, 0.96, 0.94, 0.97, 0.95, 0.99) == ("warn", True)  # median below, the range reaches it
    assert verdict(0.985, 0.99, 0.995, 0.99, 0.985, 0.99) == ("warn", False)  # slower, within the line
    assert verdict(0.99, 1.01, 1.0, 0.98, 1.02, 1.0) == ("pass", False)
    s = ab.paired_statistic([1.03, 1.05, 1.04, 1.02, 1.06, 1.05], c)
    assert s["verdict"] == "pass" and "faster" in s["state"] and s["b_faster_pairs"] == 6


def test_power_bench_replays_the_ab_rule_on_recorded_pairs() -> None:
    """bench/canary/canary_power.py --ab re-judges recorded canaries under other lines: the same sequential
    rule, on the pairs that were measured; a replay that would need more pairs is 'unjudged'."""
    from bench.canary.ab_power import ab_rejudge

    c = config.CanaryConfig(ab_fail_pct=1.0)
    slow = [0.95, 0.96, 0.94, 0.97, 0.95, 0.96]
    assert ab_rejudge(slow, 6, 12, c) == "fail" and ab_rejudge(slow, 4, 12, c) == "fail"
    assert ab_rejudge(slow, 8, 12, c) == "unjudged"  # only 6 pairs were measured
    # Median below the line, one pair above it: undecided at 6 and 8 (the interval is the range),
    # decided at 10 (the interval drops the top pair).
    mixed = [0.95, 0.96, 0.94, 0.97, 0.95, 1.00, 0.96, 0.95, 0.96, 0.97]
    assert ab_rejudge(mixed, 6, 6, c) == "warn" and ab_rejudge(mixed, 6, 12, c) == "fail"
    assert ab_rejudge(mixed[:8], 6, 12, c) == "unjudged"
    assert ab_rejudge([1.0, 0.99, 1.01, 1.02, 0.995, 1.0], 6, 12, c) == "pass"
    assert ab_rejudge(slow, 6, 12, config.CanaryConfig(ab_fail_pct=10.0)) == "warn"  # slower, within 10%
