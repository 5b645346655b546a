"""The device's peak FLOP/s for MFU: one rule for every loop (moeguard's trainer, GuardedStep in
torchtitan, the transformers Trainer or any PyTorch loop), so an MFU means the same everywhere.

GPU: a table of bf16 dense peaks per GPU model, matched on the CUDA device name; an
unknown GPU gets no peak (MFU is not computed rather than guessed). Checked against the names the
driver reports on the machines we run: 'NVIDIA H100 80GB HBM3' -> H100 SXM 989e12 and 'NVIDIA
H200' -> 989e12 (an 8192^3 bf16 matmul reaches 798 and 788 TFLOP/s there: 81% and 80% of it).

On CPU a peak measured by each run (a few wall-clock matmuls at start-up) is not a peak: on a
shared 2-core VM it read 1.1-2.1e10 FLOP/s across five runs, and runs showed MFU up to 361%. So
the CPU peak is pinned per machine class (`cpu_machine_class()`: CPU vendor, model name, family
and model numbers, logical core count; never the hostname) in configs/cpu_peaks.toml, measured
once per class with

    python -m guard.runtime.peak --pin          # --measure: print only

as best-of-N one-thread matmul FLOPs per second of *thread CPU time* (time the thread actually
ran, so neighbours on a shared host do not shrink it) times the logical core count: what the
machine could do with every core busy. A run pinned to fewer torch threads than the class has
cores is held to the peak of the cores it can use: per-core peak x threads (a 1-thread canary
worker on a 2-core class divides by half the pinned peak, not all of it), and the source says so.
A class with no entry gets no peak: MFU is NaN and tokens/s is the measure (the app and the
progress bar say so), never a guess.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import sys
import time
import tomllib
from pathlib import Path

import torch

from guard.resources import resource

# bf16 dense (no sparsity) peaks from vendor datasheets; see docs REFERENCE. Matched in order on
# the lower-cased device name; every listed token must appear. More specific entries first.
GPU_PEAK_BF16: list[tuple[tuple[str, ...], float, str]] = [
    (("gb200",), 2.5e15, "GB200"),
    (("b200",), 2.25e15, "B200"),
    (("b300",), 2.25e15, "B300"),
    (("h200",), 989e12, "H200"),
    (("h100", "nvl"), 835e12, "H100 NVL"),
    (("h100", "pcie"), 756e12, "H100 PCIe"),
    (("h100", "hbm3"), 989e12, "H100 SXM"),
    (("h100", "sxm"), 989e12, "H100 SXM"),
    (("a100",), 312e12, "A100"),
    # One MI250X package is two GCDs and torch sees each GCD as a device: 383e12 / 2 each.
    (("mi250x",), 383e12 / 2, "MI250X (one GCD: half of 383e12 per package)"),
    (("mi300x",), 1307e12, "MI300X"),
]
# Names that contain a table token but are a different part: never guess.
_NOT_IN_TABLE = ("h200 nvl", "gh200", "gb300", "mi300a")

_CACHE: dict[tuple[str, int | None, torch.dtype, int], tuple[float | None, str]] = {}


def peak_flops(device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> tuple[float | None, str]:
    """(peak FLOP/s or None, where the number came from). Cached per process."""
    device = torch.device(device)
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    threads = torch.get_num_threads() if device.type == "cpu" else 0
    key = (device.type, index, dtype, threads)
    if key not in _CACHE:
        if device.type == "cpu":
            _CACHE[key] = pinned_cpu_peak(dtype, threads=threads)
        elif device.type == "cuda":
            _CACHE[key] = _gpu_table(torch.cuda.get_device_name(index), dtype)
        else:
            _CACHE[key] = (None, f"unknown device '{device}': MFU not computed")
    return _CACHE[key]


def _gpu_table(name: str, dtype: torch.dtype) -> tuple[float | None, str]:
    low = name.lower()
    if not any(bad in low for bad in _NOT_IN_TABLE):
        for tokens, peak, label in GPU_PEAK_BF16:
            if all(t in low for t in tokens):
                if dtype not in (torch.bfloat16, torch.float16):
                    return (
                        None,
                        f"'{name}': table has bf16/fp16 dense peaks only, not {dtype}: MFU not computed",
                    )
                return peak, f"table: {label} bf16 dense ('{name}')"
    return None, f"unknown device '{name}': MFU not computed"


# ---------------------------------------------------------------------------------------------
# CPU: one pinned peak per machine class.

CPU_PEAKS_FILE = resource("configs", "cpu_peaks.toml")  # the checkout's, or the wheel's share/moeguard
CPU_PEAKS_VERSION = 1
_DTYPE_KEY = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    out: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return out
    for line in text.splitlines():
        if not line.strip():
            break
        k, _, v = line.partition(":")
        out[k.strip()] = v.strip()
    return out


def cpu_machine_class(info: dict[str, str] | None = None, cores: int | None = None) -> str:
    """'cpu-authenticamd-amd-epyc-f26-m2-2c': vendor, model name, family and model numbers (VMs
    often show a bare 'AMD EPYC'; the numbers tell Zen 4 from Zen 5) and logical cores."""
    info = _cpuinfo() if info is None else info
    cores = (os.cpu_count() or 1) if cores is None else cores
    name = info.get("model name") or platform.processor() or platform.machine() or "unknown"
    parts = [info.get("vendor_id", ""), name]
    if "cpu family" in info:
        parts.append(f"f{info['cpu family']}")
    if "model" in info:
        parts.append(f"m{info['model']}")
    slug = re.sub(r"[^a-z0-9]+", "-", " ".join(p for p in parts if p).lower()).strip("-")
    return f"cpu-{slug}-{cores}c"


def load_cpu_peaks(path: Path = CPU_PEAKS_FILE) -> dict[str, dict]:
    """machine class -> its entry ({} when the file is missing)."""
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        return {}
    if data.get("version") != CPU_PEAKS_VERSION:
        raise ValueError(f"{path}: version {data.get('version')!r}, this moeguard reads {CPU_PEAKS_VERSION}")
    classes = data.get("classes", {})
    return classes if isinstance(classes, dict) else {}


def pinned_cpu_peak(
    dtype: torch.dtype,
    machine_class: str | None = None,
    path: Path = CPU_PEAKS_FILE,
    *,
    threads: int | None = None,
) -> tuple[float | None, str]:
    """(peak FLOP/s or None, where it came from) for this machine class from the pinned file;
    with `threads` below the class's cores, the peak of that many cores (per-core x threads)."""
    cls = machine_class or cpu_machine_class()
    key = _DTYPE_KEY.get(dtype, str(dtype))
    entry = load_cpu_peaks(path).get(cls, {})
    peak = entry.get(key)
    where = "configs/cpu_peaks.toml" if path == CPU_PEAKS_FILE else str(path)
    if isinstance(peak, int | float) and peak > 0:
        cores = entry.get("cores")
        cores = int(cores) if isinstance(cores, int) and cores > 0 else (os.cpu_count() or 1)
        used = cores if threads is None or threads <= 0 else min(threads, cores)
        scaled = f", x {used}/{cores} cores: the run uses {threads} torch thread(s)" if used < cores else ""
        return float(peak) * used / cores, (
            f"pinned: {cls} {key} in {where}, measured {entry.get('measured', '?')} "
            f"({entry.get('method', '?')}){scaled}"
        )
    return None, (
        f"no pinned {key} peak for CPU class {cls} in {where}: MFU not computed, "
        "tokens/s is the measure (pin one with `python -m guard.runtime.peak --pin`)"
    )


def measure_cpu_core_peak(dtype: torch.dtype, n: int = 1024, repeats: int = 20) -> float:
    """Best-of-`repeats` FLOP/s of one n x n matmul on one thread, per second of thread CPU time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(n, n, dtype=dtype)
        b = torch.randn(n, n, dtype=dtype)
        torch.mm(a, b)  # warm-up: allocator, kernel selection
        best = float("inf")
        for _ in range(repeats):
            t0 = time.thread_time()
            torch.mm(a, b)
            dt = time.thread_time() - t0
            if dt > 0:
                best = min(best, dt)
    finally:
        torch.set_num_threads(threads)
    return 2.0 * n**3 / best


def measure_cpu_peaks(sizes: tuple[int, ...] = (512, 1024, 2048), repeats: int = 20) -> dict[str, object]:
    """A pinned-file entry for this machine: per-core best over matmul sizes, times the cores."""
    cores = os.cpu_count() or 1
    entry: dict[str, object] = {
        "cpu_model": _cpuinfo().get("model name", platform.processor()),
        "cores": cores,
    }
    for dtype in (torch.float32, torch.bfloat16):
        core = max(measure_cpu_core_peak(dtype, n, repeats) for n in sizes)
        entry[_DTYPE_KEY[dtype]] = float(f"{core * cores:.4g}")
    entry["measured"] = datetime.date.today().isoformat()
    entry["torch"] = torch.__version__
    entry["method"] = (
        f"best of {repeats} one-thread {'/'.join(map(str, sizes))}^3 matmuls per thread CPU second, "
        f"x {cores} cores"
    )
    return entry


def _toml_value(v: object) -> str:
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, float):
        return f"{v:.4g}" if "e" in f"{v:.4g}" or "." in f"{v:.4g}" else f"{v:.1f}"
    return str(v)


def write_cpu_peaks(classes: dict[str, dict], path: Path = CPU_PEAKS_FILE) -> None:
    lines = [
        "# Pinned CPU peak FLOP/s per machine class, read by guard/runtime/peak.py for MFU on CPU.",
        "# One entry per class, measured once with `python -m guard.runtime.peak --pin` on that class (see the",
        "# module docstring for the method). Keys: guard.runtime.peak.cpu_machine_class(); never a hostname.",
        f"version = {CPU_PEAKS_VERSION}",
    ]
    for cls in sorted(classes):
        lines += ["", f'[classes."{cls}"]']
        lines += [f"{k} = {_toml_value(v)}" for k, v in classes[cls].items()]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m guard.runtime.peak",
        description="Measure this machine's CPU peak "
        "FLOP/s and pin it for its machine class in configs/cpu_peaks.toml.",
    )
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--measure", action="store_true", help="measure and print, change nothing")
    g.add_argument("--pin", action="store_true", help="measure and write this class's entry")
    g.add_argument("--show", action="store_true", help="print this machine's class and its pinned peaks")
    p.add_argument(
        "--file", type=Path, default=CPU_PEAKS_FILE, help="the pinned-peak file (default %(default)s)"
    )
    args = p.parse_args(argv)
    cls = cpu_machine_class()
    if args.show:
        print(f"machine class {cls}")
        for dtype in (torch.float32, torch.bfloat16):
            print(f"  {pinned_cpu_peak(dtype, cls, args.file)}")
        return 0
    entry = measure_cpu_peaks()
    print(f"machine class {cls}: " + ", ".join(f"{k} {v}" for k, v in entry.items()))
    if args.pin:
        classes = load_cpu_peaks(args.file)
        classes[cls] = entry
        write_cpu_peaks(classes, args.file)
        print(f"pinned in {args.file}: commit it", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
