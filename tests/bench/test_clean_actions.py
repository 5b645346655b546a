"""bench/drills/clean_actions.py on one short recorded run of a real transformers family with a 50x
gradient spike injected: ours (replayed) and the peers' real code both flag that step, and the
table counts it for each (the full bench over twelve clean 1,000-step runs is in
docs/BENCHMARKS.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("olmo_core")

from bench.drills import clean_actions, real_models  # noqa: E402

SPIKE = 160


@pytest.mark.slow
def test_a_spike_is_counted_for_ours_and_for_each_peer(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    real_models.main(
        ["--observe", "--families", "mixtral", "--steps", "200", "--inject", f"gradspike@{SPIKE}:50",
         "--keep", str(tmp_path)]
    )  # fmt: skip
    run = tmp_path / "mixtral-0"
    mine, dets, _ = clean_actions.ours(run, clean_actions.defaults_toml(tmp_path))
    assert SPIKE in mine and "grad_norm_spike" in dets
    flagged = clean_actions.peers(run)
    assert SPIKE in flagged["Lightning"] and SPIKE in flagged["ZClip"], flagged
    capsys.readouterr()
    assert clean_actions.main([str(run)]) == 0
    table = capsys.readouterr().out
    row = next(line for line in table.splitlines() if line.startswith("| mixtral-0 |"))
    assert f"{SPIKE}" in row.split("|")[3]  # ours: acting steps
