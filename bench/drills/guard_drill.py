"""The fault drill as a benchmark: clean vs faulty-unguarded vs faulty-guarded, same seed.

    python bench/drills/guard_drill.py --steps 400 --write-docs

Acceptance (issue 3): the guarded run ends within 2% of the clean run's final loss; the
unguarded run ends measurably worse or diverges.

Writes docs/BENCHMARKS.md › Detection › Guard drill (issue 3).
"""

from __future__ import annotations

import sys
from pathlib import Path as _P

sys.path.insert(0, str(_P(__file__).resolve().parents[2]))  # `python bench/<group>/x.py` from a checkout

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from trainer.demo import DEFAULT_FAULTS, as_dict, drill, format_table  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=None)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", type=Path, default=None, help="where to keep the runs (default: a temp dir)")
    ap.add_argument("--inject", action="append", default=None)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads per run (1 is fastest on a busy box)"
    )
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    faults = args.inject or DEFAULT_FAULTS
    parent = args.runs or Path(tempfile.mkdtemp(prefix="drill-"))
    results = drill(args.config, args.steps, args.seed, parent, faults, progress=False, threads=args.threads)
    table = format_table(results)
    clean, unguarded, guarded = results
    gap = (guarded.final_loss - clean.final_loss) / clean.final_loss
    worse = (not math.isfinite(unguarded.final_loss)) or unguarded.final_loss > clean.final_loss * 1.02
    verdict = "PASS" if abs(gap) <= 0.02 and worse else "FAIL"
    print(table)
    print(json.dumps([as_dict(r) for r in results], indent=1))
    from bench.common.docs import machine_line, write_section

    body = f"""## Guard drill (issue 3)

`python bench/drills/guard_drill.py --steps {args.steps} --write-docs` ({machine_line()})

Tiny config, seed {args.seed}, {args.steps} steps per run. Faults: `{" ".join(faults)}`.
"final loss" is the mean loss over the last 10% of steps; "worst MaxVio (end)" is the worst layer's mean
MaxVio over the same steps.

{table}

Guarded vs clean final loss: **{gap:+.2%}** (target within 2%); unguarded: **{
        "diverged"
        if not math.isfinite(unguarded.final_loss)
        else f"{(unguarded.final_loss - clean.final_loss) / clean.final_loss:+.2%}"
    }**
(target: measurably worse or diverged). Result: **{verdict}**.
"""
    if args.write_docs:
        write_section("guard_drill", body)


if __name__ == "__main__":
    main()
