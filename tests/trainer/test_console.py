"""What the terminal says (issue #31, item 9): an action line fits a terminal line, the bar's
action counter is current, goodput is defined in --help, warnings are counted in the summary,
and with no terminal a plain progress line comes every few steps."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from guard.core import schema
from guard.core.events import Event
from guard.runtime.record import verdict_summary
from guard.store.runstore import RunStore
from tests.conftest import REPO
from tests.helpers_collector import make_report
from trainer import console


def verdict(det: str, value: float, thr: float, **detail: object) -> Event:
    return Event(
        step=7,
        kind=schema.EV_VERDICT,
        detector=det,
        value=value,
        threshold=thr,
        action=schema.ACT_SKIP,
        detail=dict(detail),
    )


def test_a_skip_on_many_verdicts_is_one_short_line_naming_the_worst() -> None:
    evs = [
        verdict(schema.DET_GRAD_SPIKE, 81.7, 11.1),
        verdict(schema.DET_LOSS_SPIKE, 9.2, 4.1),
        *[verdict(schema.DET_LAYER_GRAD_SPIKE, 40.0 + i, 20.0, layer=i) for i in range(3)],
    ]
    (line,) = console.action_lines(7, schema.ACT_SKIP, evs)
    assert len(line) <= console.LINE_CHARS, (len(line), line)
    assert line == (
        "guard step 7: skip <- 5 verdicts, worst grad_norm_spike 81.7 > 11.1 (all in the events table)"
    )
    (one,) = console.action_lines(7, schema.ACT_SKIP, evs[:1])  # one verdict: said in full as before
    assert one == "guard step 7: skip <- grad_norm_spike = 81.7 (threshold 11.1)"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def run_console(
    monkeypatch: pytest.MonkeyPatch, total: int, acted_at: int, *, tty: bool = False
) -> tuple[console.Console, list[str], str]:
    err = Terminal() if tty else io.StringIO()  # StringIO: not a terminal, like a CI runner's log
    monkeypatch.setattr(sys, "stderr", err)
    c = console.Console("r", total)
    c.progress(0)
    postfixes = []
    acts = {a: 0 for a in (schema.ACT_SKIP,)}
    for step in range(1, total + 1):
        if step == acted_at:
            acts[schema.ACT_SKIP] = 1
        c.advance(step, make_report(step - 1), acts)
        postfixes.append(c.bar.postfix or "" if c.bar is not None else "")
    c.close()
    return (
        c,
        [ln for ln in err.getvalue().replace("\r", "\n").splitlines() if ln.startswith("progress r:")]
        + ["\x00".join(postfixes)],
        err.getvalue(),
    )


def test_the_bars_action_count_is_current_and_plain_lines_come_without_a_terminal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, out, _ = run_console(monkeypatch, 100, acted_at=13, tty=True)
    per_step = out[-1].split("\x00")
    assert "guard actions 0" in per_step[11] and "guard actions 1" in per_step[12]  # step 13, not 15
    assert "tok/s last step" in per_step[-1]  # which tokens/s it is
    _, out, _ = run_console(monkeypatch, 100, acted_at=13)
    plain = out[:-1]
    assert len(plain) == 20 and plain[0].startswith("progress r: step 5/100 | loss")
    assert plain[-1].startswith("progress r: step 100/100") and "guard actions 1" in plain[-1]


def test_no_bar_floods_a_log_that_is_not_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    c, out, text = run_console(monkeypatch, 100, acted_at=13)
    assert c.bar is None
    assert "\r" not in text and "it/s" not in text and "step/s" not in text and "%|" not in text, text[:500]
    lines = text.splitlines()
    assert len(lines) == 20 and all(ln.startswith("progress r: step ") for ln in lines), lines[:3]


def test_the_summary_counts_warnings(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "r", flush_every=10)
    store.write_meta({"run_id": "r"})
    for s in range(20):
        store.add_step(make_report(s))
    for s in (3, 4, 5, 6, 7):
        store.add_event(
            Event(step=s, kind=schema.EV_VERDICT, detector=schema.DET_THROUGHPUT, value=1.0, threshold=2.0)
        )
    store.add_event(verdict(schema.DET_GRAD_SPIKE, 9.0, 2.0))  # acted on: an action, not a warning
    store.close()
    said = verdict_summary(tmp_path / "r")
    assert said.startswith("warnings: 5 verdict(s) the guard recorded without acting (throughput_drop 5)")
    empty = RunStore(tmp_path / "e", flush_every=10)
    empty.write_meta({"run_id": "e"})
    empty.close()
    assert verdict_summary(tmp_path / "e") == ""


def test_train_help_defines_goodput() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "guard", "train", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0
    text = " ".join(p.stdout.split())
    assert "goodput = productive step time / wall time since the run's first start" in text
