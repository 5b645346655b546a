"""Which parts the Runs page checks for truncation: every part of the open segment (however many a
short run's frequent flushes left) and the newest before it, a flat cost in the run's length."""

from __future__ import annotations

from pathlib import Path

from dashboards.data.loaders import NEWEST_PARTS, _runs_page_parts
from guard.store import layout, summary


def _parts(tmp_path: Path, steps: list[int], *, compacted_upto: int = 0) -> list[Path]:
    d = tmp_path / "steps"
    d.mkdir()
    out = []
    for seq, first in enumerate(steps):
        if first < compacted_upto:
            name = layout.compacted_part_name(first, first + layout.SEGMENT_STEPS - 1, seq, seq)
        else:
            name = layout.part_name(first, seq)
        (d / name).write_bytes(b"")
        out.append(d / name)
    return out


def test_a_short_run_has_every_part_checked(tmp_path: Path) -> None:
    parts = _parts(tmp_path, list(range(0, 80, 3)))  # 27 parts, one open segment
    assert _runs_page_parts(parts) == parts


def test_a_collectors_open_segment_has_its_newest_parts_checked(tmp_path: Path) -> None:
    """A part per checkpoint (the collector's copy): the newest summary.TAIL_MAX, as the writer's
    summary lists them, not a stat() of up to ~1,000 parts a table per run."""
    parts = _parts(tmp_path, list(range(0, 900)))
    assert _runs_page_parts(parts) == parts[-summary.TAIL_MAX :]


def _long_run(root: Path, closed_segments: int) -> list[Path]:
    seg = layout.SEGMENT_STEPS
    closed = [k * seg for k in range(closed_segments)]
    tail = [closed_segments * seg + 50 * i for i in range(12)]  # the live tail: 12 flushes
    root.mkdir()
    return _parts(root, closed + tail, compacted_upto=closed_segments * seg)


def test_a_long_run_checks_its_open_segment_and_the_newest_before_it(tmp_path: Path) -> None:
    parts = _long_run(tmp_path / "a", 30)
    assert _runs_page_parts(parts) == parts[30 - NEWEST_PARTS : 30] + parts[30:]
    # flat in the run's length: ten times the closed segments, the same number of checks
    assert len(_runs_page_parts(_long_run(tmp_path / "b", 300))) == NEWEST_PARTS + 12
