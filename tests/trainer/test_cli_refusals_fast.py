"""`moeguard train` refuses a bad config fast, and a GPU config on a host without a GPU (issue #40,
items 5 and 11).

A config error used to take 12-29 s on a busy host: torch (and the whole trainer) was imported
before the config was read. Now the config and the command line are checked first, and the
process that refuses them never imports torch. A config whose train.device is "cuda" on a host
with no CUDA device is one line naming the setting and its override, exit 2, nothing written
(configs/gpu-small.toml on a CPU host grew to 21.7 GB in 3 minutes instead).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer.test_cli import one_line_error

REPO = Path(__file__).resolve().parents[2]

# The refusal in a child process, then whether that process imported torch.
PROBE = (
    "import sys\n"
    "from guard.cli import main\n"
    "code = main(sys.argv[1:])\n"
    "print('torch imported' if 'torch' in sys.modules else 'no torch', file=sys.stderr)\n"
    "sys.exit(code)\n"
)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("--config", "/nonexistent.toml"), "/nonexistent.toml"),
        (("--set", "train.device=gpu"), "train.device"),
        (("--set", "model.top_k=99"), "top_k"),
        (("--set", "data.seq_len=1"), "data.seq_len"),
        (("--inject", "nan@x"), "nan@x"),
    ],
)
def test_a_config_error_is_refused_before_torch_is_imported(args: tuple[str, ...], named: str) -> None:
    p = subprocess.run(
        [sys.executable, "-c", PROBE, "train", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 2, p.stderr[-3000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert lines[-1] == "no torch", lines
    assert len(lines) == 2 and "config error" in lines[0] and named in lines[0], lines


@pytest.mark.parametrize("config", ["gpu-small.toml", "gpu-multinode.toml"])
def test_a_gpu_config_on_a_host_without_one_is_refused(tmp_path: Path, config: str) -> None:
    run = tmp_path / "r"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no CUDA device, whatever the host has
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "guard",
            "train",
            "--config",
            str(REPO / "configs" / config),
            "--run-dir",
            str(run),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    line = one_line_error(p)
    assert "train.device = 'cuda'" in line and "--set train.device=cpu" in line, line
    assert not run.exists()  # nothing written


def test_the_override_it_names_gets_past_the_refusal() -> None:
    from trainer.cli import check_device

    check_device("cpu")  # what --set train.device=cpu asks for: no refusal
    check_device("auto")


def test_an_injection_is_echoed_as_written() -> None:
    p = subprocess.run(
        [sys.executable, "-c", PROBE, "train", "--steps", "3", "--inject", "nan@999"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = p.stderr.splitlines()[0]
    assert "--inject nan@999: past the run's last step" in line and "nan@999:0" not in line, line


def test_canary_without_history_names_every_mode() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "guard", "canary"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 2, p.stderr
    line = one_line_error(p)
    assert "--history FILE is required" in line and "--ab A B" in line and "--matrix" in line, line
