"""bench/drills/clean_actions.py on one short recorded run of a real transformers family with a 50x
gradient spike injected: ours (replayed) and the peers' real code both flag that step; the table
counts it for each peer, and not for ours, which keeps a spike the run's grad clip (1.0, recorded in
meta.json) bounds as the unguarded step (the full bench over twelve clean 1,000-step runs is in
docs/BENCHMARKS.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("olmo_core")

from bench.detection.spike_replay import replay  # noqa: E402
from bench.drills import clean_actions, real_models  # noqa: E402

SPIKE = 160


@pytest.mark.slow
def test_a_spike_is_counted_for_ours_and_for_each_peer(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    real_models.main(
        ["--observe", "--families", "mixtral", "--steps", "200", "--inject", f"gradspike@{SPIKE}:50",
         "--keep", str(tmp_path)]
    )  # fmt: skip
    run = tmp_path / "mixtral-0"
    guard = clean_actions.defaults_toml(tmp_path)
    flagged = [r for r in replay(run, guard) if r["step"] == SPIKE and r["detector"] == "grad_norm_spike"]
    assert flagged and {r["would"] for r in flagged} == {"none"}, (
        flagged
    )  # flagged, kept within the grad clip
    mine, _, _ = clean_actions.ours(run, guard)
    assert SPIKE not in mine
    theirs = clean_actions.peers(run)
    assert SPIKE in theirs["Lightning"] and SPIKE in theirs["ZClip"], theirs
    capsys.readouterr()
    assert clean_actions.main([str(run)]) == 0
    table = capsys.readouterr().out
    row = next(line for line in table.splitlines() if line.startswith("| mixtral-0 |"))
    assert f"{SPIKE}" not in row.split("|")[3]  # ours: acting steps (the spike was kept)
