"""What each guard would do on clean runs of real models: ours (the default guard config,
replayed through `moeguard replay`, the same detectors and policy as a live run) against the
peers' real code at their published defaults (OLMo-core's SkipStepOptimizer sigma_factor 6,
Lightning's SpikeDetection rtol 2, ZClip z_thresh 2.5 which clips rather than skips), on the
same recorded grad-norm and loss series. No fault is injected: every step a rule acts on is an
action a healthy run did not ask for, or a natural spike the rules agree on.

    python -m bench.drills.real_models --observe --seeds 0,1 --steps 1000 --batch 8 --seq 128 --keep DIR
    python -m bench.drills.clean_actions DIR/* [--write-docs]

Ours counts steps where the replay would skip, roll back or halt (grad norm, per-layer grad norm,
loss, non-finite). A finite grad-norm spike the run's own grad clip bounds is kept as the unguarded
step (the default, `clip_spikes`): no action, not counted; the replay reads the grad clip from the
run's meta.json. A run recorded before GuardedStep recorded it reads such a spike as `clip`, counted
(an upper bound). Routing corrections (bias_correct) are counted apart: they change no step.
Peers judge the total grad norm and the loss, each series on its own, from step 0 (their own
warm-ups apply). "Shared" counts our acting steps that a peer flags too (same step).

Writes docs/BENCHMARKS.md › Detection › Actions on clean runs of real models: ours vs the peers'
real code at their defaults.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common.docs import machine_line, write_section
from bench.detection.detector_heldout import real_flags
from bench.detection.spike_replay import acting, replay
from guard.store.reader import read_table

PEERS = (("OLMo-core", 6.0), ("Lightning", 2.0), ("ZClip", 2.5))
STEP_ACTIONS = ("skip", "clip", "rollback", "halt")
SECTION = "clean_actions"


def ours(run_dir: Path, guard: str) -> tuple[list[int], list[str], int]:
    """(steps ours would act on, the detectors that asked, routing corrections)."""
    rows = acting(replay(run_dir, guard))
    steps = sorted({r["step"] for r in rows if r["would"] in STEP_ACTIONS})
    dets = sorted({r["detector"] for r in rows if r["would"] in STEP_ACTIONS})
    routing = len({(r["step"], r.get("layer")) for r in rows if r["would"] == "bias_correct"})
    return steps, dets, routing


def defaults_toml(folder: Path) -> str:
    """An empty guard TOML in `folder`: `moeguard replay --guard` then runs GuardConfig()'s defaults."""
    p = folder / "defaults.toml"
    p.write_text("# the defaults\n")
    return str(p)


def peers(run_dir: Path) -> dict[str, list[int]]:
    """Per peer, the steps it flags on either series (grad norm or loss)."""
    s = read_table(run_dir, "steps").sort("step")
    out = {}
    for name, value in PEERS:
        flags = np.zeros(s.height, dtype=bool)
        for series in ("grad_norm", "loss"):
            f = real_flags(name, value, s[series].to_numpy())
            if f is None:
                raise SystemExit(f"{name} is not installed: pip install -e '.[bench]'")
            flags |= f
        out[name] = s["step"].to_numpy()[flags].tolist()
    return out


def _runs_arg(runs: list[Path]) -> str:
    """The runs as typed: DIR/* when they are every run under one folder."""
    parents = {r.parent for r in runs}
    if len(parents) == 1:
        parent = parents.pop()
        if sorted(runs) == sorted(p for p in parent.iterdir() if p.is_dir()):
            return f"{parent}/*"
    return " ".join(str(r) for r in runs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="recorded run stores (no fault injected)")
    ap.add_argument("--guard", help="guard TOML for ours (default: the defaults, GuardConfig())")
    ap.add_argument("--write-docs", action="store_true", help="replace the section in docs/BENCHMARKS.md")
    a = ap.parse_args(argv)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        guard = a.guard or defaults_toml(Path(tmp))
        rows, totals, n_steps = [], {"ours": 0, **{n: 0 for n, _ in PEERS}}, 0
        shared = {n: 0 for n, _ in PEERS}
        for run in a.runs:
            steps = read_table(run, "steps").height
            n_steps += steps
            mine, dets, routing = ours(run, guard)
            theirs = peers(run)
            totals["ours"] += len(mine)
            cells = []
            for name, _ in PEERS:
                totals[name] += len(theirs[name])
                shared[name] += len(set(mine) & set(theirs[name]))
                cells.append(f"{len(theirs[name])}")
            rows.append(
                f"| {run.name} | {steps} | {len(mine)} {mine if mine else ''} "
                f"| {', '.join(dets) or '-'} | {routing} | " + " | ".join(cells) + " |"
            )
            print(rows[-1], file=sys.stderr, flush=True)
    per_k = {k: 1000 * v / max(n_steps, 1) for k, v in totals.items()}
    lines = [
        "## Actions on clean runs of real models: ours vs the peers' real code at their defaults",
        "",
        f"`python -m bench.drills.clean_actions {_runs_arg(a.runs)}` "
        f"({machine_line()}; {(time.time() - t0) / 60:.1f} min)",
        "",
        (__doc__ or "").split("\n\n")[0].replace("\n", " "),
        "",
        "| run | steps | ours: acting steps | ours: asked by | ours: routing corrections | "
        + " | ".join(f"{n} (default {v:g}): flagged steps" for n, v in PEERS)
        + " |",
        "|---|---|---|---|---|" + "---|" * len(PEERS),
        *rows,
        f"| **all** | {n_steps} | **{totals['ours']}** ({per_k['ours']:.2f} per 1k) | | | "
        + " | ".join(f"**{totals[n]}** ({per_k[n]:.2f} per 1k; {shared[n]} of ours shared)" for n, _ in PEERS)
        + " |",
    ]
    text = "\n".join(lines)
    print(text)
    if a.write_docs:
        write_section(SECTION, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
