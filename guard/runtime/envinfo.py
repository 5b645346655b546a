"""The environment fingerprint stored in meta.json (what a canary or the Compare page groups by).

One fingerprint for every loop: moeguard's trainer and GuardedStep (torchtitan, the transformers
Trainer, any loop) write the same keys, so their runs group and compare alike."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path
from typing import Any

import torch


def git_sha(where: Path | None = None) -> str:
    """The commit of the checkout at `where` (default: moeguard's own), or 'unknown' outside one."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=where or Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu:{platform.machine()}:{torch.get_num_threads()}threads"


def fingerprint(
    *,
    device: torch.device,
    dtype: str,
    peak_flops: float | None,
    peak_source: str,
    attention_backend: str,
    expert_kernel: str,
    compile: bool,
    world_size: int,
    code_dir: Path | None = None,
) -> dict[str, Any]:
    """`code_dir`: the checkout of the training code whose commit is `git_sha` (default moeguard's:
    its own trainer; an integration passes the user's working directory)."""
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "python": platform.python_version(),
        "device": device_name(device),
        "device_type": device.type,
        "peak_flops": peak_flops,
        "peak_flops_source": peak_source,
        "attention_backend": attention_backend,
        "expert_kernel": expert_kernel,
        "compile": compile,
        "dtype": dtype,
        "git_sha": git_sha(code_dir),
        "world_size": world_size,
    }


def hardware_key(env: dict[str, Any]) -> str:
    """Fingerprint of the hardware class alone (canary baselines compare like with like)."""
    return f"{env['device']}|ws{env['world_size']}|{env['dtype']}"
