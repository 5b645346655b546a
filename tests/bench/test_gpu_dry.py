"""bench/gpu/run.sh, the one-command GPU bench (issue #42), kept from rotting between lent GPUs:
`--dry` runs every part's code on CPU at tiny sizes (real torchtitan launches, real Trainers, a
real collector on loopback, real `moeguard canary` workers), and gpu.json must hold every part,
each run to the end ("ok"), with the figures the GPU run reports; what needs CUDA says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from bench.gpu.common import FORMAT, PART_NAMES, PARTS, SKIPPED_CUDA, STATUS_OK  # noqa: E402
from bench.gpu.hf_part import SYNC_STEPS  # noqa: E402
from bench.gpu.report import merge  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "bench" / "gpu" / "run.sh"


def run_sh(*args: str, out: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    return subprocess.run(
        [str(RUN), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def dry(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("gpu-out")
    p = run_sh("--dry", out=out, timeout=sum(q.dry_box_s + 10 for q in PARTS) + 60)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out, json.loads((out / "gpu.json").read_text())


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(sum(q.dry_box_s + 10 for q in PARTS) + 300)
def test_dry_run_writes_every_part_within_the_device_tools_limits(dry: tuple[Path, dict]) -> None:
    out, res = dry
    # what the device tool brings back: at most 8 files, no deeper than 2 folders
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert files == ["gpu.json", "gpu.md", "run.log"]
    assert res["format"] == FORMAT and res["dry"] is True
    assert res["device"]["device"] == "cpu" and res["commit"]
    assert res["install"]["status"].startswith("skipped")
    assert list(res["parts"]) == list(PART_NAMES)
    for name, part in res["parts"].items():
        assert part["status"] == STATUS_OK, (name, part["status"], part["not_done"], part.get("log_tail"))
        assert part["exit"] == 0 and 0 < part["took_s"] <= part["box_s"] + 10


@pytest.mark.slow
@pytest.mark.integration
def test_dry_run_figures(dry: tuple[Path, dict]) -> None:
    out, res = dry
    tt, hf = res["parts"]["torchtitan"]["results"], res["parts"]["hf_trainer"]["results"]
    first, last = tt["setup"]["sync_steps"]
    n_tt = (last - first + 1) * tt["overhead"]["pairs"]
    for r in (tt, hf):
        o = r["overhead"]
        lo, hi = o["overhead_ci95"]
        assert lo <= o["overhead"] <= hi and o["pairs"] >= 1
        # set_sync_debug_mode is CUDA's; the counter around it ran on every step it was given
        assert r["syncs"].startswith(SKIPPED_CUDA), r["syncs"]
    assert tt["syncs"].endswith(f"ran on {n_tt} + {n_tt} steps"), tt["syncs"]
    assert hf["syncs"].endswith(f"ran on {SYNC_STEPS} + {SYNC_STEPS} steps"), hf["syncs"]
    assert tt["runs_streamed"] == tt["overhead"]["pairs"]  # every guarded launch reached the collector
    mfu = tt["mfu"]
    # ours is NaN on a CPU class with no pinned peak (guard/runtime/peak.py): a number, not a figure
    assert isinstance(mfu["ours_pct"], float) and mfu["torchtitan_pct"] is not None
    assert mfu["peaks"]["torchtitan"] > 0
    acting = res["parts"]["acting"]["results"]
    assert acting["nan"]["ok"] and acting["nan"]["action"] == "skip", acting["nan"]
    assert all(acting["nan"]["unchanged"].values())
    # the default clip_spikes keeps a finite spike: flagged, then applied like the unguarded step
    spike = acting["spike x50"]
    assert spike["ok"] and spike["action"] == "apply" and "grad_norm_spike" in spike["flagged"], spike
    assert not spike["unchanged"]["weights"]
    assert acting["collapse"]["ok"], acting["collapse"]
    slowed = res["parts"]["canary"]["results"]["B slowed 5%"]
    assert slowed["verdict"] in ("pass", "warn", "fail") and slowed["n_pairs"] == 2
    (matrix,) = [v for k, v in res["parts"]["matrix"]["results"].items() if k.startswith("matrix ")]
    cells = {c["cell"]: c for c in matrix["cells"]}
    assert cells["attention=math"]["status"] == "reference" and cells["attention=flash"]["mfu_median"] > 0
    md = (out / "gpu.md").read_text()
    assert md.startswith("## GPU\n") and "DRY RUN" in md
    for name in PART_NAMES:
        assert f"| {name} | ok |" in md


def test_help_names_every_part_and_its_box(tmp_path: Path) -> None:
    p = run_sh("--help", out=tmp_path)
    assert p.returncode == 0, p.stderr
    for name in PART_NAMES:
        assert f"  {name} " in p.stdout
    assert "box 130 s" in p.stdout and "--dry" in p.stdout


def test_bad_arguments_exit_2_naming_the_value(tmp_path: Path) -> None:
    p = run_sh("--frobnicate", out=tmp_path)
    assert p.returncode == 2 and "'--frobnicate'" in p.stderr
    p = run_sh("--dry", "--only", "torchtitan,nope", out=tmp_path)
    assert p.returncode == 2 and "'nope'" in p.stderr


def test_a_killed_part_keeps_what_it_finished_and_a_missing_one_says_so(tmp_path: Path) -> None:
    # the files run.sh and a part leave behind when `timeout` kills the part mid-way
    (tmp_path / "torchtitan.json").write_text(
        json.dumps({"status": "ok", "results": {"overhead": {"overhead": 0.004}}, "not_done": []})
    )
    (tmp_path / "torchtitan.rc").write_text("124 130.0\n")
    (tmp_path / "torchtitan.log").write_text("step 40 ...")
    (tmp_path / "hf_trainer.rc").write_text("1 3.0\n")
    res = merge(tmp_path, dry=False)
    tt = res["parts"]["torchtitan"]
    assert tt["status"].startswith("partial: timed out") and tt["results"]["overhead"]["overhead"] == 0.004
    assert tt["log_tail"] == "step 40 ..."
    assert res["parts"]["hf_trainer"]["status"] == "failed: exit 1, no part file"
    assert res["parts"]["matrix"]["status"] == "failed: never started"
