"""What host sampling (guard/runtime/host.py) adds to a step: `moeguard train`'s micro config
(tests/data/micro.toml, ~10 ms a step on one core) run in this process with sampling off
(MOEGUARD_HOST_EVERY_S=0), at the default 1 s, and at 5 ms (a sample nearly every step: the
per-sample cost made visible), interleaved round by round (the order rotating), so host-load
drift hits every variant alike.

Writes docs/BENCHMARKS.md › Overhead: what the guard costs a step › Host sampling (issue #40).

Per variant: the median over rounds of the run's median step_time_s and of its summed step time
(the whole loop's cost: a sample's GIL share lands in whichever step it overlaps).

    python bench/overhead/host_sample_overhead.py --rounds 6 --steps 300 [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from guard.core import schema  # noqa: E402
from guard.store.reader import read_table  # noqa: E402

VARIANTS = {"off": "0", "default 1 s": "1", "every 5 ms": "0.005"}


def one_run(every: str, steps: int, root: Path, i: int) -> tuple[float, float, int]:
    from trainer.config import load_config
    from trainer.loop import Trainer

    os.environ[schema.ENV_HOST_EVERY] = every
    cfg = load_config(
        REPO / "tests" / "data" / "micro.toml", {"train.steps": steps, "train.checkpoint_every": 10_000}
    )
    run = root / f"r{i}"
    Trainer(cfg, run, progress=False).run()
    t = read_table(run, schema.TABLE_STEPS)["step_time_s"].sort()[5:]  # step 0-4: warm-up
    samples = read_table(run, schema.TABLE_HOST).height
    return float(t.median()), float(t.sum()), samples


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    res: dict[str, dict[str, list[float]]] = {v: {"median": [], "sum": [], "samples": []} for v in VARIANTS}
    names = list(VARIANTS)
    with tempfile.TemporaryDirectory() as tmp:
        i = 0
        for r in range(a.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for v in order:
                med, tot, n = one_run(VARIANTS[v], a.steps, Path(tmp), i)
                i += 1
                for k, x in (("median", med), ("sum", tot), ("samples", n)):
                    res[v][k].append(x)
                print(
                    f"round {r} {v:12s} median {med * 1e3:.2f} ms  sum {tot:.2f} s  samples {n}", flush=True
                )
    base = statistics.median(res["off"]["median"])
    base_sum = statistics.median(res["off"]["sum"])
    out = {}
    for v in names:
        med, tot = statistics.median(res[v]["median"]), statistics.median(res[v]["sum"])
        out[v] = {
            "median_step_ms": med * 1e3,
            "vs_off_median_pct": 100 * (med / base - 1),
            "sum_s": tot,
            "vs_off_sum_pct": 100 * (tot / base_sum - 1),
            "samples": statistics.median(res[v]["samples"]),
        }
        print(
            f"{v:12s} median step {med * 1e3:.2f} ms ({out[v]['vs_off_median_pct']:+.1f}%), "
            f"loop {tot:.2f} s ({out[v]['vs_off_sum_pct']:+.1f}%), {out[v]['samples']:.0f} samples"
        )
    if a.json:
        a.json.write_text(
            json.dumps({"rounds": a.rounds, "steps": a.steps, "variants": out, "raw": res}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
