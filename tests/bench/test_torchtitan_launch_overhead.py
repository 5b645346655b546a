"""bench/overhead/torchtitan_launch_overhead.py: its arguments are checked before anything launches."""

from __future__ import annotations

import pytest

from bench.overhead import torchtitan_launch_overhead as bench


@pytest.mark.parametrize(
    ("argv", "word"),
    [
        (["--pairs", "0"], "--pairs"),
        (["--steps", "0"], "--steps"),
        (["--steps", "10", "--warmup", "9"], "--warmup"),
    ],
)
def test_bad_arguments_exit_2_naming_the_flag(
    argv: list[str], word: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2 and word in capsys.readouterr().err
