"""`moeguard replay RUN_DIR [--guard FILE.toml]`: run the detectors and policy over a recorded run.

It rebuilds each step's StepReport from the run store (guard/store/reader.py, a window of steps at
a time: memory stays bounded at any run length) and feeds the same
engine (detectors, LR bound, policy: guard/core/engine.py) the trainer uses, then prints what
they would have done next to what the run did. Use
it to tune thresholds: a verdict on a step you know was healthy is a false alarm to fix.
`--guard FILE` is layered over the settings the run was recorded with (a file naming one key
changes that key only), and the keys it changed are printed. A damaged part file is skipped with a
warning naming it (guard/store/reader.py); the rest of the run is replayed.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from guard.core import schema
from guard.core.config import GuardConfig
from guard.core.engine import Engine
from guard.core.policy import resolve_clip
from guard.core.tomlconf import ConfigError, from_dict, load_toml, to_dict
from guard.store.reader import (
    DamagedPartWarning,
    damaged_parts,
    raw_ranges,
    read_meta,
    read_reports,
    scan_table,
)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path, help="a run folder (runs/<run_id>)")
    p.add_argument(
        "--guard",
        type=Path,
        metavar="FILE.toml",
        help="guard settings to try, layered over the ones the run was recorded with: keys the file "
        "leaves out keep their recorded values (default: the recorded settings as they are)",
    )
    p.add_argument("--all", action="store_true", help="list every step with a verdict (default: first 50)")
    p.add_argument("--json", action="store_true", help="print the replayed events as JSON lines")
    p.add_argument(
        "--ladder",
        action="store_true",
        help="first print the escalation ladder per fault kind at these settings",
    )


@dataclass(slots=True)
class ReplayRow:
    step: int
    detector: str
    value: float
    threshold: float
    layer: int | None
    would: str
    did: str


def replay(
    run_dir: Path, cfg: GuardConfig, max_lr: float | None = None, grad_clip: float | None = None
) -> list[ReplayRow]:
    """Every verdict the detectors give on the run's recorded steps under `cfg`, with what the
    policy would do (`would`) and what the run did (`did`). `grad_clip`: the run's own (0: none);
    with it a finite grad-norm spike resolves as the live run resolves it (kept where that clip
    bounds it, else skipped: guard/core/policy.py resolve_clip); without it (a run that did not
    record one) such a spike reads `clip`."""
    engine = Engine(cfg, max_lr=max_lr)
    rows: list[ReplayRow] = []
    for rep in read_reports(run_dir):
        d = engine.decide(rep, rep.lr)
        if grad_clip is not None:
            resolve_clip(d, rep.grad_norm, grad_clip)
        for ev in d.events:
            if ev.kind != schema.EV_VERDICT:
                continue
            rows.append(
                ReplayRow(
                    rep.step,
                    ev.detector,
                    ev.value,
                    ev.threshold,
                    ev.detail.get("layer"),
                    ev.action,
                    rep.action,
                )
            )
    return rows


def guard_config_of(run_dir: Path, override: Path | None) -> tuple[GuardConfig, float | None]:
    """The run's recorded guard settings with `override`'s keys (its `[guard]` table, or the whole
    file when it has none) layered over them, in act mode; and the recorded peak LR."""
    meta = read_meta(run_dir)
    if meta is None:
        raise ConfigError(f"{run_dir} is not a run folder (no meta.json)")
    recorded = meta.get("config", {})
    max_lr = recorded.get("optim", {}).get("lr")
    cfg = from_dict(GuardConfig, recorded.get("guard", {}), prefix="guard.")
    if override is not None:
        data = load_toml(override)
        cfg = from_dict(GuardConfig, data.get("guard", data), prefix="guard.", base=cfg)
    cfg.mode = "act"  # replay asks what an acting guard would do, even for an observe-mode run
    return cfg, max_lr


def recorded_grad_clip(run_dir: Path) -> float | None:
    """The run's own grad clip as its meta.json records it (`config.optim.grad_clip`: moeguard's
    trainer, GuardedStep and the adapters built on it), or None for a run that did not record one."""
    meta = read_meta(run_dir) or {}
    value = meta.get("config", {}).get("optim", {}).get("grad_clip")
    return float(value) if isinstance(value, int | float) else None


def changed_keys(before: GuardConfig, after: GuardConfig) -> list[str]:
    """`guard.KEY old -> new` for every setting that differs (nested tables flattened)."""

    def flat(d: dict, prefix: str) -> dict[str, object]:
        out: dict[str, object] = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    a, b = flat(to_dict(before), "guard."), flat(to_dict(after), "guard.")
    return [f"{k} {a[k]!r} -> {b[k]!r}" for k in sorted(a) if a[k] != b.get(k)]


def run(args: argparse.Namespace) -> int:
    if not args.run_dir.is_dir():
        raise ConfigError(f"run folder {str(args.run_dir)!r} does not exist")
    cfg, max_lr = guard_config_of(args.run_dir, args.guard)
    for d in damaged_parts(args.run_dir):
        print(f"moeguard replay: warning: {d.message()}", file=sys.stderr)
    with warnings.catch_warnings():  # printed once above, not again per table scan
        warnings.simplefilter("ignore", DamagedPartWarning)
        return _run(args, cfg, max_lr)


def _run(args: argparse.Namespace, cfg: GuardConfig, max_lr: float | None) -> int:
    if getattr(args, "ladder", False) and not args.json:
        from guard.core.policy import ladder

        print("escalation ladder (guard/core/policy.py, docs/escalation.md):")
        for kind, rungs in ladder(cfg):
            print(f"  {kind}: " + "; ".join(f"{i}. {r}" for i, r in enumerate(rungs, 1)))
    rows = replay(args.run_dir, cfg, max_lr, recorded_grad_clip(args.run_dir))
    if args.json:
        for r in rows:
            print(
                json.dumps(
                    {
                        "step": r.step,
                        "detector": r.detector,
                        "value": r.value,
                        "threshold": r.threshold,
                        "layer": r.layer,
                        "would": r.would,
                        "did": r.did,
                    }
                )
            )
        return 0
    n_steps = scan_table(args.run_dir, schema.TABLE_STEPS).select(pl.len()).collect().item()
    if args.guard:
        recorded, _ = guard_config_of(args.run_dir, None)
        changed = changed_keys(recorded, cfg)
        print(
            f"replayed {n_steps} steps of {args.run_dir.name} with the recorded guard settings, "
            f"{args.guard} layered over them: " + ("; ".join(changed) if changed else "it changes nothing")
        )
    else:
        print(f"replayed {n_steps} steps of {args.run_dir.name} with the recorded guard settings")
    kept = raw_ranges(args.run_dir)
    if kept is not None:  # a long run: per-layer / per-expert rows retired outside these ranges
        n_kept = sum(b - a + 1 for a, b in kept)
        print(
            f"per-layer and per-expert rows are kept for {n_kept:,} of those steps ({len(kept)} ranges: around "
            "every incident and the newest steps); elsewhere only the step-level detectors had rows to judge"
        )
    if not rows:
        print("no verdicts: the detectors would have stayed quiet on every step")
        return 0
    shown = rows if args.all else rows[:50]
    print(f"{'step':>7}  {'detector':<22} {'layer':>5} {'value':>12} {'threshold':>12}  {'would':<13} did")
    for r in shown:
        layer = "" if r.layer is None else str(r.layer)
        print(
            f"{r.step:>7}  {r.detector:<22} {layer:>5} {r.value:>12.4g} {r.threshold:>12.4g}  {r.would:<13} {r.did}"
        )
    if len(rows) > len(shown):
        print(f"... {len(rows) - len(shown)} more (use --all)")
    by_det: dict[str, int] = {}
    for r in rows:
        by_det[r.detector] = by_det.get(r.detector, 0) + 1
    print("verdicts by detector: " + ", ".join(f"{k} {v}" for k, v in sorted(by_det.items())))
    return 0
