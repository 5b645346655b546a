"""Part `torchtitan`: torchtitan's own Trainer, plain vs guarded (streaming to a collector on
loopback), launches interleaved A B / B A while the time box allows: the overhead, our MFU beside
torchtitan's own mfu(%), and host syncs a step.

Each launch is one process (`python -m bench.gpu.tt_main`, one rank: RANK/WORLD_SIZE/MASTER_* set
here rather than by torchrun, whose start-up would eat the box) training bench/gpu/tt_registry.py's
model for `steps` steps. Step times: FaultyLoss's timer (bench/common/torchtitan_registry.py, the same in
A and B) at each step's loss; a launch's step time is the mean interval over its steady steps
(after `warmup`), which is the total time of those steps whatever runs ahead on the device.
Overhead = median over pairs of B/A - 1; its 95% interval is a bootstrap over the pairs and, within
each launch, over its steps (so a one-pair run still gets an interval from its step noise).
Host syncs: steps SYNC_STEPS (in the warm-up) run under set_sync_debug_mode in both variants.
MFU: ours is the guard's run store (rank 0) `mfu` over the steady steps, torchtitan's the `mfu:`
of its log lines at those steps; both peaks are recorded.

Writes docs/BENCHMARKS.md › GPU, through `bench/gpu/report.py`: no section of its own.
"""

from __future__ import annotations

import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.gpu.common import SKIPPED_CUDA, TARGET_MFU_AGREE_PP, TARGET_OVERHEAD, PartLog
from bench.gpu.tt_main import ENV_SYNC_FILE, ENV_SYNCS
from bench.gpu.tt_registry import LOG_FREQ

REPO = Path(__file__).resolve().parents[2]
SYNC_STEPS = (3, 8)  # torchtitan steps (1-based) counted for host syncs: inside the warm-up
# (config, steps a launch, warm-up steps, most pairs)
# dry: 11 steps, the fewest that hold the sync steps (3-8) and a steady window (steps 5-10, from
# one log step to the next: 5 intervals) with a torchtitan mfu(%) line in it (step 10)
SIZES = {"gpu": ("gpu_moe", 60, 10, 4), "dry": ("dry_moe", 11, 5, 1)}
ANSI = re.compile(r"\x1b\[[0-9;]*m")
LOG_LINE = re.compile(r"step:\s*(\d+)\s.*?mfu:\s*([0-9.]+|N/A)%?")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(tmp: Path, name: str, *, guarded: bool, config: str, steps: int, url: str, box_s: float) -> dict:
    """One launch: its step timestamps, torchtitan's logged mfu and the counted syncs."""
    timing = tmp / f"{name}-times"
    timing.mkdir()
    syncs = tmp / f"{name}-syncs.jsonl"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "MOEGUARD_TT_TIMING_DIR": str(timing),
        ENV_SYNCS: f"{SYNC_STEPS[0]}:{SYNC_STEPS[1]}",
        ENV_SYNC_FILE: str(syncs),
    }
    if not _cuda():
        env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "bench.gpu.tt_main", "--module", "bench.gpu.tt_registry", "--config", config]
    cmd += ["--training.steps", str(steps), "--dump_folder", str(tmp / name / "out")]
    run_dir = tmp / "runs" / name
    cmd += ["--run-dir", str(run_dir), "--collector", url] if guarded else ["--no-guard"]
    if guarded and ring_size() is not None:
        (tmp / "guard.toml").write_text(f"[policy]\nring_size = {ring_size()}\n")
        cmd += ["--guard", str(tmp / "guard.toml")]
    log = tmp / f"{name}.log"
    t0 = time.perf_counter()
    with open(log, "wb") as f:
        try:
            rc = subprocess.run(
                cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=box_s
            ).returncode
        except subprocess.TimeoutExpired:
            rc = -9
    text = ANSI.sub("", log.read_text(errors="replace"))
    if rc != 0:
        raise RuntimeError(
            f"{name}: exit {rc} after {time.perf_counter() - t0:.0f} s; log tail:\n{text[-2500:]}"
        )
    times = [float(line.split()[1]) for line in (timing / "times-r0.txt").read_text().splitlines()]
    mfu = {int(m[1]): float(m[2]) for m in LOG_LINE.finditer(text) if m[2] != "N/A"}
    counted = [json.loads(x) for x in syncs.read_text().splitlines()] if syncs.is_file() else []
    return {
        "times": times,
        "tt_mfu_pct": mfu,
        "syncs": counted,
        "run_dir": run_dir,
        "wall_s": time.perf_counter() - t0,
    }


def ring_size() -> int | None:
    """The guard's snapshot ring on this device: its default (4 snapshots of weights and AdamW
    state, 16 bytes a parameter each, kept on the GPU) fits beside the 1.36 B model on an H200's
    141 GB, not on an H100's 80: there one snapshot. A snapshot costs the same time whatever the
    ring holds, so the overhead measured is the same."""
    import torch

    if not torch.cuda.is_available():
        return None
    return None if torch.cuda.get_device_properties(0).total_memory >= 100 * 2**30 else 1


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def step_time(times: list[float], warmup: int) -> tuple[float, np.ndarray]:
    """(mean interval over the steady steps, those intervals). The window runs from a step that
    follows one of torchtitan's log steps to another: a log step reads the loss (a host sync), so
    at both ends the host has waited for the device, and work run ahead on the device cannot
    fall outside the window (the plain loop syncs only there; the guarded one every step)."""
    first = -(-warmup // LOG_FREQ) * LOG_FREQ  # 0-based step index right after a log step
    last = (len(times) - 1) // LOG_FREQ * LOG_FREQ
    dt = np.diff(np.asarray(times[first : last + 1]))
    if dt.size < 2:
        raise RuntimeError(f"only {dt.size} steady step intervals (steps {len(times)}, warm-up {warmup})")
    return float(dt.mean()), dt


def overhead_ci(pairs: list[tuple[np.ndarray, np.ndarray]], n: int = 2000, seed: int = 0) -> list[float]:
    """95% bootstrap interval of the median over pairs of mean(B)/mean(A) - 1, resampling the
    pairs and, inside each launch, its step intervals."""
    rng = np.random.default_rng(seed)
    meds = np.empty(n)
    for i in range(n):
        pick = rng.integers(0, len(pairs), len(pairs))
        r = []
        for j in pick:
            a, b = pairs[j]
            r.append(
                b[rng.integers(0, b.size, b.size)].mean() / a[rng.integers(0, a.size, a.size)].mean() - 1
            )
        meds[i] = np.median(r)
    lo, hi = np.percentile(meds, [2.5, 97.5])
    return [float(lo), float(hi)]


def our_mfu(run_dir: Path, first_step: int) -> dict[str, Any]:
    """The guard's MFU over the steady steps (guard step = torchtitan step - 1) and its peak."""
    from guard.store.reader import read_meta, read_table

    steps = read_table(run_dir, "steps")
    mfu = [float(x) for s, x in zip(steps["step"], steps["mfu"], strict=True) if s + 1 > first_step]
    meta = read_meta(run_dir) or {}
    return {
        "mfu_pct_median": 100 * statistics.median(mfu) if mfu else None,
        "steps": len(mfu),
        "meta_peak": {k: v for k, v in meta.items() if "peak" in k or "flops" in k},
    }


def peaks() -> dict[str, Any]:
    import torch

    from guard.runtime.peak import peak_flops

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ours, source = peak_flops(dev)
    out: dict[str, Any] = {"ours": ours, "ours_source": source}
    try:
        from torchtitan.tools.utils import get_peak_flops

        name = torch.cuda.get_device_name(0) if dev == "cuda" else "cpu"
        out["torchtitan"] = get_peak_flops(name)
    except Exception as e:  # noqa: BLE001 - recorded
        out["torchtitan"] = f"unknown: {e}"
    return out


def run(log: PartLog, *, dry: bool, deadline: float) -> None:
    from bench.overhead.torchtitan_launch_overhead import TOKEN, start_collector

    config, steps, warmup, max_pairs = SIZES["dry" if dry else "gpu"]
    os.environ["MOEGUARD_TOKEN"] = TOKEN
    import tempfile

    cuda = _cuda()
    log.put(
        "setup",
        {
            "config": config,
            "steps_per_launch": steps,
            "warmup": warmup,
            "sync_steps": SYNC_STEPS,
            "guard_ring_size": ring_size() or "default",
        },
    )
    pairs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="moeguard-gpu-tt-") as d:
        tmp = Path(d)
        collector, url = start_collector(tmp)
        try:
            longest = 0.0
            for i in range(max_pairs):
                left = deadline - time.monotonic()
                if i > 0 and left < 2.3 * longest:
                    # by design (up to max_pairs while the box allows), not a failure
                    log.put("pairs_stopped", f"{left:.0f} s left, a pair takes ~{2 * longest:.0f} s")
                    break
                got = {}
                for guarded in (False, True) if i % 2 == 0 else (True, False):
                    name = f"{'b' if guarded else 'a'}{i}"
                    got[guarded] = launch(
                        tmp,
                        name,
                        guarded=guarded,
                        config=config,
                        steps=steps,
                        url=url,
                        box_s=max(10.0, deadline - time.monotonic()),
                    )
                    longest = max(longest, got[guarded]["wall_s"])
                pairs.append(got)
                _summarise(log, pairs, warmup, cuda)
            if pairs:
                log.piece("mfu", lambda: _mfu(pairs, warmup))
            import httpx

            auth = {"Authorization": f"Bearer {TOKEN}"}
            listed = httpx.get(f"{url}/v1/runs", headers=auth, timeout=30).json().get("runs", [])
            log.put("runs_streamed", sum(1 for x in listed if str(x.get("run", "")).startswith("b")))
        finally:
            collector.terminate()
            collector.wait(30)


def _summarise(log: PartLog, pairs: list[dict[str, Any]], warmup: int, cuda: bool) -> None:
    ratios, samples, med_a, med_b = [], [], [], []
    for p in pairs:
        (ta, da), (tb, db) = step_time(p[False]["times"], warmup), step_time(p[True]["times"], warmup)
        ratios.append(tb / ta - 1)
        samples.append((da, db))
        med_a.append(ta)
        med_b.append(tb)
    over = float(np.median(ratios))
    lo, hi = overhead_ci(samples)
    log.put(
        "overhead",
        {
            "pairs": len(pairs),
            "step_s_plain": statistics.median(med_a),
            "step_s_guarded": statistics.median(med_b),
            "overhead": over,
            "overhead_ci95": [lo, hi],
            "pair_ratios": ratios,
            "target": TARGET_OVERHEAD,
            "met": hi <= TARGET_OVERHEAD if cuda else None,
            "launch_wall_s": [round(p[g]["wall_s"], 1) for p in pairs for g in (False, True)],
        },
    )
    a = [x["syncs"] for p in pairs for x in p[False]["syncs"]]
    b = [x["syncs"] for p in pairs for x in p[True]["syncs"]]
    if not cuda:
        log.put(
            "syncs",
            f"{SKIPPED_CUDA} (torch.cuda.set_sync_debug_mode); the counter ran on {len(a)} + {len(b)} steps",
        )
        return
    if not a or not b:
        log.not_done("syncs", "no step was counted (the sync counter wrote nothing)")
        return
    log.put(
        "syncs",
        {
            "steps_counted": [len(a), len(b)],
            "plain_per_step": statistics.median(a),
            "guarded_per_step": statistics.median(b),
            "guard_extra_per_step": statistics.median(b) - statistics.median(a),
            "plain_all": a,
            "guarded_all": b,
            "target_extra": 1,
        },
    )


def _mfu(pairs: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Ours and torchtitan's on the guarded launches' steady steps (torchtitan logs every 5 steps)."""
    ours, theirs = [], []
    for p in pairs:
        b = p[True]
        o = our_mfu(b["run_dir"], warmup + 1)
        if o["mfu_pct_median"] is not None:
            ours.append(o["mfu_pct_median"])
        theirs += [v for s, v in b["tt_mfu_pct"].items() if s > warmup + 1]
    plain = [v for p in pairs for s, v in p[False]["tt_mfu_pct"].items() if s > warmup + 1]
    out: dict[str, Any] = {
        "ours_pct": statistics.median(ours) if ours else None,
        "torchtitan_pct": statistics.median(theirs) if theirs else None,
        "torchtitan_plain_pct": statistics.median(plain) if plain else None,
        "peaks": peaks(),
        "target_agree_pp": TARGET_MFU_AGREE_PP,
    }
    if out["ours_pct"] is not None and out["torchtitan_pct"] is not None:
        out["diff_pp"] = out["ours_pct"] - out["torchtitan_pct"]
    return out
