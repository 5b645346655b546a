"""One part of the GPU bench: `python -m bench.gpu.parts NAME --work DIR [--dry]` (run.sh runs
each under `timeout`; bench/gpu/common.py lists the parts). Writes DIR/NAME.json as it goes.

Writes docs/BENCHMARKS.md › GPU, through `bench/gpu/report.py`: no section of its own.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

from bench.gpu.common import PART_NAMES, PartLog, device_info, part


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.parts", description=__doc__)
    ap.add_argument("name", help=f"one of {', '.join(PART_NAMES)}")
    ap.add_argument("--work", type=Path, required=True, help="folder of the part files")
    ap.add_argument("--dry", action="store_true", help="tiny sizes on CPU (seconds)")
    ap.add_argument("--box", type=float, help="seconds this part may take (default: its time box)")
    a = ap.parse_args(argv)
    if a.name not in PART_NAMES:
        print(f"part {a.name!r}: one of {', '.join(PART_NAMES)}", file=sys.stderr)
        return 2
    p = part(a.name)
    box = a.box if a.box is not None else (p.dry_box_s if a.dry else p.box_s)
    # finish a few seconds inside run.sh's `timeout`, so the part ends on its own terms
    deadline = time.monotonic() + 0.92 * box - 3
    a.work.mkdir(parents=True, exist_ok=True)
    log = PartLog(a.work / f"{a.name}.json", a.name, dry=a.dry)
    try:
        log.put("device", device_info())
        _run(a.name, log, dry=a.dry, deadline=deadline)
    except Exception as e:  # noqa: BLE001 - the part's file says what broke
        log.data["status"] = f"failed: {type(e).__name__}: {e}"[:300]
        log.not_done(a.name, traceback.format_exc()[-3000:])
        log.data["status"] = f"failed: {type(e).__name__}: {e}"[:300]
        log.save()
        return 1
    return 0


def _run(name: str, log: PartLog, *, dry: bool, deadline: float) -> None:
    if name == "torchtitan":
        from bench.gpu import tt_part

        tt_part.run(log, dry=dry, deadline=deadline)
    elif name == "hf_trainer":
        from bench.gpu import hf_part

        hf_part.run(log, dry=dry, deadline=deadline)
    elif name in ("matrix", "canary"):
        from bench.gpu import canary_part

        (canary_part.run_matrix if name == "matrix" else canary_part.run_ab)(log, dry=dry, deadline=deadline)
    elif name == "acting":
        from bench.gpu import acting_part

        acting_part.run(log, dry=dry, deadline=deadline)


if __name__ == "__main__":
    raise SystemExit(main())
