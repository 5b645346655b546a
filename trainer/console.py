"""What the user sees on stderr while a run trains: one line per thing the guard did, and the
progress bar (rank 0). Lines go above the bar, so the bar stays whole. An action line fits a
terminal line: several verdicts read "5 verdicts, worst grad_norm_spike 81.7 > 11.1" (every one is
in the events table). With no terminal (stderr not a tty: CI logs, a pipe) a plain progress line
also comes every `plain_every()` steps, so a long run is never silent until its end."""

from __future__ import annotations

import math
import sys
import time
from typing import Any

from guard.core import actions, schema
from guard.core.events import Event
from guard.core.report import StepReport


def _evidence(ev: Event) -> str:
    """'grad_norm_spike = 45.3 (threshold 3.1)', 'nonfinite grad_norm layers [1]': a verdict in a few words."""
    d = ev.detail
    where = f" layer {d['layer']}" if "layer" in d else (f" layers {d['layers']}" if d.get("layers") else "")
    if ev.detector == schema.DET_NONFINITE:
        return f"{ev.detector} {'/'.join(d.get('signals') or [])}{where}".replace("  ", " ")
    value = f" = {ev.value:.4g}" if math.isfinite(ev.value) else ""
    limit = f" (threshold {ev.threshold:.4g})" if math.isfinite(ev.threshold) else ""
    return f"{ev.detector}{where}{value}{limit}"


LINE_CHARS = 120  # an action line longer than this says the worst verdict and how many there were


def _worst(verdicts: list[Event]) -> str:
    """'5 detectors, worst grad_norm_spike 81.7 > 11.1': the verdict furthest past its threshold."""

    def excess(e: Event) -> float:
        ok = math.isfinite(e.value) and math.isfinite(e.threshold) and e.threshold > 0
        return e.value / e.threshold if ok else (math.inf if e.detector == schema.DET_NONFINITE else 0.0)

    w = max(verdicts, key=excess)
    where = f" layer {w.detail['layer']}" if "layer" in w.detail else ""
    past = (
        f" {w.value:.4g} > {w.threshold:.4g}" if math.isfinite(w.value) and math.isfinite(w.threshold) else ""
    )
    return f"{len(verdicts)} verdicts, worst {w.detector}{where}{past} (all in the events table)"


def action_lines(step: int, action: str, events: list[Event]) -> list[str]:
    """One concise line per thing the guard did at `step`: the action, the detector and its evidence."""
    out = []
    if action in (schema.ACT_SKIP, schema.ACT_ROLLBACK, schema.ACT_HALT):
        why = [_evidence(e) for e in events if e.kind == schema.EV_VERDICT and e.action == action]
        what = action
        for e in events:
            if e.kind == schema.EV_ACTION and e.action == schema.ACT_ROLLBACK:
                what = (
                    f"rollback to the snapshot of step {e.detail.get('restored_step', '?')}, "
                    f"{e.detail.get('skip_batches', 0)} batches skipped"
                )
                why = why or [str(e.detail.get("reason", ""))]
            elif e.kind == schema.EV_ACTION and e.action == schema.ACT_LR_COOLDOWN:
                what += f", LR x{e.value:g} for {e.detail.get('steps')} steps"
            elif e.kind == schema.EV_HALT:
                what, why = "halt", [str(e.detail.get("reason", ""))]
            elif e.kind == schema.EV_OPERATOR:
                why = why or [f"operator command ({e.detail.get('reason') or 'no reason given'})"]
        line = f"guard step {step}: {what} <- {'; '.join(w for w in why if w) or 'policy'}"
        verdicts = [e for e in events if e.kind == schema.EV_VERDICT and e.action == action]
        if len(line) > LINE_CHARS and len(verdicts) > 1:
            line = f"guard step {step}: {what} <- {_worst(verdicts)}"
        out.append(line)
    for e in events:
        if e.kind == schema.EV_ACTION and e.action == schema.ACT_BIAS_CORRECT:
            d = e.detail
            out.append(
                f"guard step {step}: {e.action} layer {d.get('layer')} ({d.get('mode')} boost x{d.get('boost', 0):g} "
                f"until step {d.get('until')}) <- {_evidence(e)}"
            )
        elif e.kind == schema.EV_RECOVERED:
            out.append(
                f"guard step {step}: layer {e.detail.get('layer')} recovered from {e.detector} "
                f"after {e.detail.get('corrected_for')} steps"
            )
    return out


def plain_every(total: int) -> int:
    """Steps between plain progress lines (no terminal): about 20 lines a run, at least every step."""
    return max(1, total // 20)


class Console:
    """stderr for one rank: `say` prints a line (above the bar when there is one); `progress`
    opens the bar (plus a plain line every few steps when stderr is no terminal), `advance`
    moves it, `close` ends it."""

    def __init__(self, desc: str, total: int) -> None:
        self.desc, self.total = desc, total
        self.bar: Any = None
        self.plain = False  # no terminal: plain progress lines instead of the bar
        self._acts = -1  # guard actions the bar's postfix shows
        self._t0 = 0.0

    def say(self, line: str) -> None:
        """A line for the user on stderr, above the progress bar (tqdm.write keeps the bar whole)."""
        if self.bar is not None:
            type(self.bar).write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def progress(self, initial: int) -> None:
        self._t0 = time.monotonic()
        # No terminal: no bar. Its carriage-return redraws reach a CI log as one flood of partial
        # lines beside the plain ones (issue #40); a plain, newline-ended line comes every
        # plain_every() steps instead.
        self.plain = not sys.stderr.isatty()
        if self.plain:
            return
        from tqdm import tqdm

        self.bar = tqdm(
            total=self.total,
            initial=initial,
            desc=self.desc,
            unit="step",
            file=sys.stderr,
            dynamic_ncols=True,
            mininterval=0.5,
        )

    def advance(self, step: int, rep: StepReport, guard_actions: dict[str, int]) -> None:
        """After step `step` - 1 ran: the bar moves one; its postfix every 5 steps, at the end, and
        whenever the guard acted (so its action count matches the action lines above it)."""
        if self.plain and (step % plain_every(self.total) == 0 or step == self.total):
            took = time.monotonic() - self._t0
            self.say(
                f"progress {self.desc}: step {step}/{self.total} | {postfix(rep, guard_actions)} | {took:.0f} s"
            )
        if self.bar is None:
            return
        self.bar.update(1)
        acts = actions.total(guard_actions)
        changed = acts != self._acts
        if step % 5 == 0 or step == self.total or changed:
            self._acts = acts
            self.bar.set_postfix_str(postfix(rep, guard_actions), refresh=changed)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.bar = None
        self.plain = False


def postfix(rep: StepReport, guard_actions: dict[str, int]) -> str:
    mfu = f"{rep.mfu * 100:.2f}%" if math.isfinite(rep.mfu) else "n/a"
    acts = actions.total(guard_actions)
    # tokens/s and MFU of the step just run (the app's figures say which window they take)
    return f"loss {rep.loss:.3f} | {rep.tokens_per_s:,.0f} tok/s last step | MFU {mfu} | guard actions {acts}"
