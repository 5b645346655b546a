"""Issue #13's attacks, replayed against the real `moeguard collector`.

    python bench/attacks/collector_attacks.py [--only clean,garbage_state,...] [--list] [--dir DIR]
                                      [--keep] [--no-progress] [--write-docs]

Each attack starts its own service process (`python -m guard collector`) on loopback in a temp dir, attacks it (bounded: at most ~200 MB sent, ~150 sockets, a
few seconds), and returns one row: what the service answered, whether it stayed up, and rows
lost, the acknowledged rows (rank-0 steps and events answered 200) missing from the run store
afterwards, read back with guard/store/reader.py after the collector stopped (rows a newer
writer superseded count as kept: they are in .collector/superseded/). "Stored twice" counts rows the live tables hold more than
once. "Held" means the service answered as designed; a DEFECT row is a finding, left as found.

I/O errors are real ones: the collector's RLIMIT_FSIZE is set to 1 byte with prlimit(2) for the
moment of the attack, so its writes fail with EFBIG (Python ignores SIGXFSZ), then lifted.
Issue #32's attacks (bench/attacks/resilience.py, edges.py): a flood of idle connections against a
collector started with a 1,024 open-files limit while a real Exporter streams; EMFILE mid-run (the
limit cut with prlimit(2) to what it has open + 8, then lifted); ENOSPC mid-run on a 32 MB tmpfs
mounted under the runs (needs root; without it the row says skipped, and the io_error_* rows'
RLIMIT_FSIZE stands in); trainer clocks an hour, a day and a month off; validation at the edge.

The attacks live in bench/attacks/ (store.py, writers.py, abuse.py, liveness.py, resilience.py,
edges.py; the pager's attacks went with `moeguard pager`, issue #29);
--write-docs writes the table into docs/BENCHMARKS.md (section collector_attacks).

Writes docs/BENCHMARKS.md › Collector › Collector and pager under attack (issues #13 and #32,
`bench/attacks/collector_attacks.py`).
"""

from __future__ import annotations

import sys
from pathlib import Path as _P

sys.path.insert(0, str(_P(__file__).resolve().parents[2]))  # `python bench/<group>/x.py` from a checkout

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.attacks import abuse, edges, liveness, resilience, store, writers
from bench.attacks.kit import Row, stop_all

ATTACKS: dict[str, Callable[[Path], Row]] = {
    "clean": store.clean,
    **{kind: store.startup_damage(kind) for kind in store.DAMAGE},
    "parts_past_999999": store.parts_past_999999,
    "io_error_mid_ingest": store.io_error_mid_ingest,
    "io_error_at_checkpoint": store.io_error_at_checkpoint,
    "second_writer": writers.second_writer,
    "same_second_writer": writers.same_second_writer,
    "older_generation": writers.older_generation,
    "seq_max": writers.seq_max,
    "idempotent_replay": store.idempotent_replay,
    "cardinality": abuse.cardinality,
    "oversized_body": abuse.oversized_body,
    "deep_nesting": abuse.deep_nesting,
    "slow_clients": abuse.slow_clients,
    "client_disconnect": abuse.client_disconnect,
    "path_traversal": abuse.path_traversal,
    "metrics_labels": abuse.metrics_labels,
    "auth": abuse.auth,
    "commands_read_no_token": abuse.commands_read_no_token,
    "malformed_fields": abuse.malformed_fields,
    "hung_rank": liveness.hung_rank,
    "idle_flood_1024": resilience.idle_flood_1024,
    "emfile_mid_run": resilience.emfile_mid_run,
    "enospc_tmpfs": resilience.enospc_tmpfs,
    "skewed_clocks": edges.skewed_clocks,
    "validation_edges": edges.validation_edges,
}


def run_one(name: str, work: Path) -> Row:
    """One attack; an attack that could not finish is a row too (nothing proven: not held)."""
    fn = ATTACKS[name]
    try:
        return fn(work)
    except Exception as e:
        doc = (fn.__doc__ or name).strip().splitlines()[0]
        return Row(
            attack=name,
            item="?",
            what=doc,
            answer=f"the attack failed: {type(e).__name__}: {e}"[:160],
            lost=-1,
        )
    finally:
        stop_all()  # whatever a failed attack left running


def markdown(rows: list[Row], command: str, machine: str, wall_s: float) -> str:
    held = sum(r.held for r in rows)
    lines = [
        "## Collector and pager under attack (issues #13 and #32, `bench/attacks/collector_attacks.py`)",
        "",
        f"`{command}` ({machine}, the cores shared with other work; {len(rows)} attacks in {wall_s:.0f} s)",
        "",
        "Each attack runs against its own real service process on loopback (the module docstring says",
        "how). Rows lost: acknowledged rows (rank-0 steps and events answered 200) missing from the run",
        "store afterwards, read back with guard/store/reader.py (rows a newer writer superseded count as",
        "kept). Held: the service",
        "answered as designed; **DEFECT**: it did not (left as found, see the item).",
        "",
        "| attack | issue item | what the service answered | stayed up | rows lost | stored twice | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lost = "?" if r.lost < 0 else str(r.lost)
        verdict = "held" if r.held else "**DEFECT**"
        lines.append(
            f"| `{r.attack}`: {_cell(r.what)} | {r.item} | {_cell(r.answer)} | {'yes' if r.up else '**no**'} "
            f"| {lost} | {r.twice} | {verdict} |"
        )
    lost, down = sum(max(r.lost, 0) for r in rows), sum(not r.up for r in rows)
    lines += [
        "",
        f"{held}/{len(rows)} held; rows lost in all: {lost}; services down after an attack: {down}.",
    ]
    return "\n".join(lines + _issue32(rows))


def _issue32(rows: list[Row]) -> list[str]:
    """Issue #32's figures over its attacks (floods, transient errors, clocks, validation)."""
    ours = [r for r in rows if r.item.startswith("32.")]
    if not ours:
        return []
    p99 = [r.p99_ms for r in ours if r.p99_ms >= 0]
    flood = f"{max(p99):.0f} ms" if p99 else "not measured"
    return [
        "",
        "Issue #32's targets, over its attacks:",
        "",
        "| attacks tried | services down | acknowledged rows lost | runs left quarantined after the condition cleared | client p99 during the flood |",
        "|---|---|---|---|---|",
        f"| {len(ours)} | {sum(not r.up for r in ours)} (target 0) | {sum(max(r.lost, 0) for r in ours)} (target 0) "
        f"| {sum(r.quarantined_after for r in ours)} (target 0) | {flood} (target < 1 s) |",
    ]


def _cell(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated attack names (default: all; see --list)")
    ap.add_argument("--list", action="store_true", help="print the attack names and exit")
    ap.add_argument("--dir", type=Path, default=None, help="where the temp dirs go (default: the system's)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dirs (service logs, run stores)")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    ap.add_argument("--write-docs", action="store_true", help="write the table into docs/BENCHMARKS.md")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(ATTACKS))
        return []
    names = [n for n in args.only.split(",") if n] or list(ATTACKS)
    unknown = [n for n in names if n not in ATTACKS]
    if unknown:
        ap.error(f"unknown attacks {unknown}; --list shows them")
    from tqdm import tqdm

    root = Path(tempfile.mkdtemp(prefix="collector-attacks-", dir=args.dir))
    t0, rows = time.monotonic(), []
    try:
        for name in (bar := tqdm(names, unit="attack", disable=args.no_progress)):
            bar.set_postfix_str(name, refresh=True)
            rows.append(run_one(name, root / name))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    wall = time.monotonic() - t0
    from bench.common.docs import machine_line, shown_command, write_section

    command = shown_command("bench/attacks/collector_attacks.py", sys.argv[1:] if argv is None else argv)
    text = markdown(rows, command, machine_line(), wall)
    print(text)
    if args.keep:
        print(f"\nservice logs and run stores kept in {root}")
    if args.write_docs:
        write_section("collector_attacks", text)
    return rows


if __name__ == "__main__":
    result = main()
    sys.exit(0 if all(r.lost == 0 and r.up for r in result) else 1)
