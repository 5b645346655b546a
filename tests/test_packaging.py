"""The built wheel: it holds what the checkout has, its core install is enough for a guarded
training job, and a part whose extra is missing says which extra in one line.

    build_wheel(tmp)      # `pip wheel` of a clean copy of the working tree (no stale build/)

The core-install test makes a clean venv (no system site-packages), installs torch 2.13.0 (CPU)
and the core wheel into it (with this interpreter's pip), checks that no service or app
dependency came along, and runs a guarded `moeguard train` there that streams to a collector
started from the full install.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from guard.core import schema
from guard.extras import EXTRAS, MissingExtra, missing, require
from tests.helpers_alerting import COLLECTOR_TOKEN, start_collector
from tests.helpers_http import http_json, wait_until

REPO = Path(__file__).resolve().parents[1]
TORCH = os.environ.get("MOEGUARD_TORCH", "2.13.0")
SERVICE_MODULES = (
    "starlette",
    "uvicorn",
    "httptools",
    "prometheus_client",
    "streamlit",
    "plotly",
    "opentelemetry",
    "grafana_client",
)


def checkout_files() -> list[str]:
    """Tracked and untracked-but-not-ignored files: what a commit of this tree would hold."""
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True
    )
    return [f for f in out.stdout.splitlines() if (REPO / f).is_file()]


def build_wheel(tmp: Path) -> Path:
    """The wheel of a clean copy of the tree (setuptools' build/ would carry deleted modules)."""
    src = tmp / "src"
    for f in checkout_files():
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, src / f)
    out = tmp / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(src),
        ],
        check=True,
        capture_output=True,
    )
    [whl] = out.glob("moeguard-*.whl")
    return whl


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def test_the_wheel_holds_every_module_and_file_the_checkout_has(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    files = checkout_files()
    modules = [
        f for f in files if f.split("/")[0] in ("guard", "trainer", "dashboards") and f.endswith(".py")
    ]
    assert modules and not [m for m in modules if m not in names], "modules missing from the wheel"
    data = [f for f in files if f.split("/")[0] in ("configs", "alerts", "playbooks")]
    share = {n.split(".data/data/share/moeguard/", 1)[1] for n in names if ".data/data/share/moeguard/" in n}
    assert {
        "configs/tiny.toml",
        "configs/canary.toml",
        "alerts/moeguard.rules.yml",
        "alerts/alertmanager.yml",
    } <= share
    assert [f for f in data if f not in share] == [], "files missing from the wheel's share/moeguard"
    grafana = [f for f in files if f.startswith("dashboards/grafana/") and f.endswith(".json")]
    assert grafana and set(grafana) <= names
    assert "guard/py.typed" in names
    assert not [n for n in names if n.startswith(("tests/", "bench/"))]


def test_a_missing_extra_is_one_line_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert missing("collector") is None  # this environment has the full install
    monkeypatch.setitem(EXTRAS, "collector", ("no_such_module_for_moeguard",))
    with pytest.raises(MissingExtra) as e:
        require("collector", "moeguard collector")
    assert str(e.value) == (
        "moeguard collector needs the 'collector' extra: pip install \"moeguard[collector]\" "
        "(no module 'no_such_module_for_moeguard')"
    )
    from guard import cli

    assert cli.main(["collector", "--help"]) == 2


def _venv_python(root: Path) -> str:
    """A clean venv without pip of its own: this interpreter's pip installs into it (`pip --python`),
    which spares ensurepip's install of pip (~3 CPU-s) that nothing here uses."""
    venv.EnvBuilder(with_pip=False, system_site_packages=False, clear=True).create(root)
    return str(root / "bin" / "python")


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_core_install_trains_guarded_and_streams_to_a_full_install_collector(
    wheel: Path, tmp_path: Path
) -> None:
    py = _venv_python(tmp_path / "core-venv")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # one resolution for torch and the wheel; --no-compile: pip would byte-compile every module of
    # torch (~10 s of CPU with the second resolution) where the few imported compile as they load
    pip = [
        sys.executable,
        "-m",
        "pip",
        "--python",
        py,
        "install",
        "-q",
        "--disable-pip-version-check",
        "--no-compile",
    ]
    subprocess.run([*pip, f"torch=={TORCH}", str(wheel)], check=True, env=env, capture_output=True)
    work = tmp_path / "work"  # not the checkout: the installed wheel, not this tree, is imported
    work.mkdir()

    def core(*args: str, **kw: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run([py, *args], cwd=work, env=env, capture_output=True, text=True, **kw)

    where = core("-c", "import guard, trainer; print(guard.__file__)")
    assert where.returncode == 0 and "core-venv" in where.stdout, where
    has = core("-c", f"import importlib.util as u; print([m for m in {SERVICE_MODULES!r} if u.find_spec(m)])")
    assert has.stdout.strip() == "[]", f"the core install pulled in {has.stdout}"
    for cmd, extra in (("collector", "collector"), ("app", "app"), ("grafana", "grafana")):
        r = core("-m", "guard", cmd, "--help")
        assert r.returncode == 2, r
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and f'pip install "moeguard[{extra}]"' in lines[0], r.stderr

    collector = start_collector(tmp_path, [])  # this interpreter: the full install
    try:
        run_env = {**env, schema.ENV_TOKEN: COLLECTOR_TOKEN}
        r = subprocess.run(
            [py, "-m", "guard", "train", "--steps", "12", "--run-dir", str(work / "runs" / "core-run"),
             "--no-progress", "--collector", collector.url, "--set", "train.threads=1",
             # the default config (the wheel's configs/tiny.toml) at a quarter of its width and
             # sequence, half its depth: what is under test is the install, not the model (~3 CPU-s)
             "--set", "model.d_model=32", "--set", "model.d_expert=32", "--set", "model.n_layers=2",
             "--set", "data.seq_len=32"],
            cwd=work, env=run_env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]

        def streamed() -> bool:
            status, body = http_json(f"{collector.url}/v1/runs", timeout=5)
            runs = {x["run"]: x for x in body["runs"]} if status == 200 else {}
            return (runs.get("core-run") or {}).get("last_step") == 11

        wait_until(streamed, timeout=60, interval=0.5, what="the collector to hold the core run's 12 steps")
    finally:
        collector.stop()
