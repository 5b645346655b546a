"""A drill whose fault lands inside a detector's warm-up says so before it runs (issue #31,
item 2): `--inject collapse@5:1` on a config whose collapse detector arms at step 20."""

from __future__ import annotations

from pathlib import Path

from tests.trainer.test_cli import train


def test_a_fault_before_its_detector_arms_is_named_with_the_step_and_setting(tmp_path: Path) -> None:
    p = train(tmp_path / "r", "--steps", "40", "--inject", "collapse@5:1", "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    notes = [ln for ln in p.stderr.splitlines() if "note:" in ln]
    assert len(notes) == 1, p.stderr[-3000:]
    assert (
        "--inject collapse@5:1" in notes[0]
        and "collapse detector arms at step 20 (collapse.warmup)" in notes[0]
    )
    # the detector did arm where the note said: its first verdict is at step 20, none before
    acts = [ln for ln in p.stderr.splitlines() if ln.startswith("guard step") and "maxvio" in ln]
    assert acts and all(int(ln.split()[2].rstrip(":")) >= 20 for ln in acts), acts


def test_the_demo_drill_says_when_a_fault_lands_in_a_warmup() -> None:
    from trainer.demo import DEFAULT_FAULTS, warmup_notices

    assert warmup_notices(None, 400, DEFAULT_FAULTS) == []  # the shipped drill's faults all land armed
    (line,) = warmup_notices(None, 400, ["collapse@100:3"])
    assert (
        "--inject collapse@100:3" in line and "collapse detector arms at step 250 (collapse.warmup)" in line
    )
