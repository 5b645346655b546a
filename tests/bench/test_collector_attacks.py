"""bench/attacks/collector_attacks.py on a fast subset against the real collector: the clean control,
one damaged run folder at start-up, a second writer on a run id. Rows lost must be 0 and each
answer the designed one (the whole bench is run by hand; its table is in docs/BENCHMARKS.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.attacks.collector_attacks import ATTACKS, main, markdown, run_one
from bench.attacks.kit import CollectorProc, Ledger, Row, batch, halt, report
from guard.collector.config import STATE_DIR, SUPERSEDED_DIR
from guard.store.writer import event_frame, report_frames, write_parts
from guard.wire.batch import parse_event

FAST = ["clean", "garbage_state", "second_writer"]


@pytest.mark.integration
def test_fast_subset_loses_nothing_and_answers_as_designed(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    rows = main(["--only", ",".join(FAST), "--no-progress", "--dir", str(tmp_path)])
    by = {r.attack: r for r in rows}
    assert list(by) == FAST
    for r in rows:
        assert r.up and r.lost == 0 and r.twice == 0 and r.held, r
    assert by["clean"].answer == "200 stored, x5"
    damaged = by["garbage_state"].answer
    assert damaged.startswith("came up; that run 503 (quarantined: .collector/state.json: unreadable"), (
        damaged
    )
    assert damaged.endswith("the other 200"), damaged
    writer = by["second_writer"].answer
    assert "newer writer 200, the 50 rows it re-runs moved to .collector/superseded/" in writer, writer
    assert "older writer 409 generation conflict" in writer and "duplicate=True" in writer, writer
    out = capsys.readouterr().out
    assert "| `clean`: a clean ingest" in out and "3/3 held; rows lost in all: 0" in out
    assert list(tmp_path.iterdir()) == []  # temp dirs removed without --keep


def test_names_and_unknown_attacks(capsys: pytest.CaptureFixture) -> None:
    assert main(["--list"]) == []
    listed = capsys.readouterr().out.split()
    assert listed == list(ATTACKS) and set(FAST) <= set(listed) and len(listed) >= 25
    with pytest.raises(SystemExit):
        main(["--only", "clean,nope"])


def test_table_marks_defects_and_unknown_losses() -> None:
    rows = [
        Row(attack="ok", item="held", what="fine", answer="200 | ok", up=True, held=True),
        Row(attack="bad", item="9", what="broken", answer="the attack failed", lost=-1),
    ]
    text = markdown(rows, "python bench/attacks/collector_attacks.py", "a machine", 1.0)
    assert "| `ok`: fine | held | 200 \\| ok | yes | 0 | 0 | held |" in text
    assert "| `bad`: broken | 9 | the attack failed | **no** | ? | 0 | **DEFECT** |" in text
    assert "1/2 held; rows lost in all: 0; services down after an attack: 1." in text


def test_ledger_counts_rows_lost_and_stored_twice(tmp_path: Path) -> None:
    """The measure itself: acknowledged rows missing, stored twice, or kept aside by a newer writer."""
    run = tmp_path / "r"
    ledger = Ledger()
    ledger.ack(batch("r", 1, range(6), [halt(5)]))
    assert ledger.check(tmp_path) == (7, 0)  # nothing stored: 6 steps and the halt lost
    write_parts(run, report_frames([report(s) for s in range(4)]), 0)
    write_parts(run, report_frames([report(s) for s in (2, 3)]), 10)
    assert ledger.check(tmp_path) == (3, 2)  # steps 4, 5 and the halt lost; 2 and 3 stored twice
    aside = run / STATE_DIR / SUPERSEDED_DIR / "00000000000000000001"
    frames = {
        **report_frames([report(s) for s in (4, 5)]),
        "events": event_frame([parse_event(halt(5), "e")]),
    }
    write_parts(aside, frames, 0)
    assert ledger.check(tmp_path) == (0, 2)


@pytest.mark.integration
def test_a_failed_attack_is_a_row_and_leaves_no_service_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started = []

    def broken(work: Path) -> Row:
        """An attack that dies half-way."""
        started.append(CollectorProc(work).start())
        raise RuntimeError("boom")

    monkeypatch.setitem(ATTACKS, "broken", broken)
    row = run_one("broken", tmp_path)
    assert (row.held, row.lost, row.what) == (False, -1, "An attack that dies half-way.")
    assert row.answer == "the attack failed: RuntimeError: boom"
    assert started[0].proc is not None and started[0].proc.poll() is not None


def test_issue32_figures_sum_over_its_attacks() -> None:
    rows = [
        Row(attack="flood", item="32.1", what="f", answer="a", up=True, held=True, p99_ms=120.4),
        Row(
            attack="disk", item="32.2", what="d", answer="a", up=True, held=False, quarantined_after=1, lost=2
        ),
        Row(attack="old", item="held", what="o", answer="a", up=False, lost=5),
    ]
    text = markdown(rows, "python bench/attacks/collector_attacks.py", "a machine", 1.0)
    assert "| 2 | 0 (target 0) | 2 (target 0) | 1 (target 0) | 120 ms (target < 1 s) |" in text
