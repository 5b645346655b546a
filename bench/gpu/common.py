"""What `bench/gpu/run.sh` measures, defined once: the parts, their time boxes, the part-file
format that each part writes and report.py merges into $OUT/gpu.json, and the sizes of a real
(GPU) run and of `--dry` (CPU, tiny, seconds).

A part is `python -m bench.gpu.parts NAME --work DIR [--dry]`, run by run.sh under
`timeout BOX`. It writes DIR/NAME.json as it goes (`PartLog.save` after every piece), so a part
killed at its time box still hands over what it finished; report.py marks such a part
"timed out" and keeps its pieces. Every piece that could not run says why in `not_done`.

Writes docs/BENCHMARKS.md › GPU, through `bench/gpu/report.py`: no section of its own.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = "moeguard-gpu-bench/1"
STATUS_OK = "ok"
STATUS_PARTIAL = "partial"  # ran, but some pieces could not (see not_done)
SKIPPED_CUDA = "skipped: needs CUDA"
TARGET_OVERHEAD = 0.01  # the guard's overhead target on a GPU (issue #42)
TARGET_MFU_AGREE_PP = 2.0  # ours vs torchtitan's own mfu(%), percentage points


@dataclass(frozen=True, slots=True)
class Part:
    name: str
    box_s: int  # the time box on a GPU (run.sh's `timeout`)
    dry_box_s: int  # the time box of --dry
    what: str


# In run order, the cheapest-to-lose last. The boxes sum to 7.75 min with the install's 45 s
# (run.sh), inside the 8 the issue allows; each part's sizes are chosen to end inside its box,
# and the open-ended ones (launch pairs, block pairs) stop when the box runs short. Dry boxes are
# only a guard against a hung CI run: the dry sizes take seconds of CPU, but a 2-core CI box at
# load 20 stretched the torchtitan part's two launches to 156 s of wall time.
PARTS: tuple[Part, ...] = (
    Part(
        "torchtitan",
        130,
        360,
        "(1) guard overhead inside torchtitan's own Trainer: a DeepSeek-V3-style MoE (~1.36 B "
        "parameters, bf16, SDPA attention, 64 experts top-6, seq 4096), plain vs guarded + "
        "streaming to a local collector, launches interleaved A B B A; (2) our MFU beside "
        "torchtitan's own mfu(%) for the same steps, and both peaks; (3) host syncs a step, plain "
        "vs guarded (set_sync_debug_mode, on warm-up steps only)",
    ),
    Part(
        "hf_trainer",
        65,
        240,
        "(1) guard overhead in the transformers Trainer with MoEGuardCallback (streaming) on a "
        "Mixtral-shaped model (~0.64 B parameters, bf16, SDPA), both Trainers in one process, "
        "blocks interleaved A B / B A; (3) host syncs a step there, plain vs guarded",
    ),
    Part(
        "acting",
        35,
        240,
        "(6) the guard acting: a NaN and a x50 spike skipped with weights and optimizer state "
        "bitwise unchanged; a forced router collapse corrected (transformers Trainer, on the GPU)",
    ),
    Part(
        "canary",
        100,
        300,
        "(5) the A/B canary (`moeguard canary --ab`): A = A (no false alarm expected) and B slowed "
        "5% (caught expected), 3 worker pairs each (--dry: the slowed one only, 2 pairs)",
    ),
    Part(
        "matrix",
        90,
        300,
        "(4) `moeguard canary --matrix`: MFU per SDPA backend (flash, efficient, math) and expert "
        "kernel (grouped_mm, loop), each cell an A/B against the reference cell, 2 pairs a cell",
    ),
)
PART_NAMES = tuple(p.name for p in PARTS)
INSTALL_BOX_S = 45


def part(name: str) -> Part:
    for p in PARTS:
        if p.name == name:
            return p
    raise ValueError(f"unknown part {name!r}: one of {', '.join(PART_NAMES)}")


def help_text() -> str:
    import textwrap

    rows = [
        textwrap.fill(
            f"{p.name:<11} box {p.box_s:>3} s (dry {p.dry_box_s:>3} s)  {p.what}",
            width=100,
            initial_indent="  ",
            subsequent_indent=" " * 38,
        )
        for p in PARTS
    ]
    total = INSTALL_BOX_S + sum(p.box_s for p in PARTS)
    return "\n".join(rows) + f"\n  (install box {INSTALL_BOX_S} s; all boxes together {total / 60:.1f} min)"


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def device_info() -> dict[str, Any]:
    import platform

    import torch

    info: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": f"{platform.machine()} {os.cpu_count()} cores",
    }
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        info["memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    else:
        info["device"] = "cpu"
    # the installed versions, read from the packages' metadata: importing them here only to read
    # __version__ cost every part ~1.3 s of CPU (transformers and torchtitan pull in most of torch)
    from importlib.metadata import PackageNotFoundError, version

    for mod in ("transformers", "torchtitan", "accelerate", "polars"):
        try:
            info[mod] = version(mod)
        except PackageNotFoundError as e:
            info[mod] = f"missing: {type(e).__name__}: {e}"[:160]
    return info


class PartLog:
    """One part's file: its pieces' results and what it could not do, saved after every piece."""

    def __init__(self, path: Path, name: str, *, dry: bool) -> None:
        self.path, self.name, self.dry = path, name, dry
        self.data: dict[str, Any] = {
            "part": name,
            "status": STATUS_OK,
            "dry": dry,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "results": {},
            "not_done": [],
        }
        self.t0 = time.perf_counter()
        self.save()

    def put(self, key: str, value: Any) -> None:
        self.data["results"][key] = value
        self.save()

    def not_done(self, what: str, why: str) -> None:
        self.data["not_done"].append({"what": what, "why": why[:2000]})
        self.data["status"] = STATUS_PARTIAL
        self.save()

    def skipped(self, why: str) -> None:
        self.data["status"] = why
        self.save()

    def piece(self, what: str, fn: Callable[[], Any]) -> Any:
        """fn()'s result stored under `what`; an exception is recorded (not raised) as not done."""
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 - a piece that fails must not end the part
            self.not_done(what, f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")
            return None
        if out is not None:
            self.put(what, out)
        return out

    def save(self) -> None:
        self.data["wall_s"] = round(time.perf_counter() - self.t0, 2)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str, allow_nan=True))
        os.replace(tmp, self.path)


# what the parts import, beyond the image's torch: checked after the install (gpu.json "install")
NEEDED = (
    "torch",
    "numpy",
    "polars",
    "pyarrow",
    "httpx",
    "tqdm",
    "starlette",
    "uvicorn",
    "prometheus_client",
    "transformers",
    "accelerate",
    "torchtitan",
    "datasets",
    "tyro",
)


def import_report() -> dict[str, Any]:
    """{module: version or the import error} for NEEDED, and whether torch sees CUDA."""
    out: dict[str, Any] = {}
    for mod in NEEDED:
        try:
            m = __import__(mod)
            out[mod] = str(getattr(m, "__version__", "ok"))
        except Exception as e:  # noqa: BLE001 - recorded
            out[mod] = f"missing: {type(e).__name__}: {e}"[:200]
    try:
        import torch

        out["cuda_available"] = torch.cuda.is_available()
        out["torch_cuda"] = torch.version.cuda
    except Exception:  # noqa: BLE001
        out["cuda_available"] = False
    return out


if __name__ == "__main__":  # run.sh: `--help` text, or the import report after the install
    if sys.argv[1:] == ["help"]:
        print(help_text())
    else:
        print(json.dumps(import_report()))
