"""Which guard events page a human at once, and the alert each one is: pure, no I/O.

The collector posts these alerts straight to Alertmanager's v2 API (guard/collector/paging.py),
seconds after the batch that carries them is durable, instead of waiting for a scrape, a rule
evaluation and the rule's `for`. Each alert is labelled exactly as the Prometheus rule in
alerts/moeguard.rules.yml that fires for the same thing (alertname, severity, scope, the rule's
`by` labels; Prometheus's external labels are added by the caller), so Alertmanager holds ONE
alert for both sources: one page, one resolve. tests/alerts/test_paging_rules.py checks each
PagedAlert against its rule (labels, `by`, window, threshold).

    book = PageBook()
    book.signal(REPEATED_NONFINITE, "r1", now)        # a non-finite rank-0 step
    book.latch(RUN_HALTED, "r1", True, now)           # the run's halt latch
    book.firing(now) -> {key: Firing(labels, annotations, starts_at)}

Two shapes, as the rules are: a latch (RunHalted fires while the run is halted, resolves when it
resumes) and a count in a sliding window (fires while at least `threshold` signals fell within
the last `window_s`; resolves when the window slides past them).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from guard.core import schema

SEVERITY = "critical"  # only pages take this path; warnings wait for Prometheus
Key = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class PagedAlert:
    alertname: str
    window_s: float  # 0: a latch
    threshold: int  # signals within the window that fire it
    by: tuple[str, ...]  # the rule's `by (...)` labels
    summary: str  # str.format(run=..., rank=...)
    description: str
    scope: str = "run"


RUN_HALTED = PagedAlert(
    "RunHalted",
    0.0,
    1,
    ("run",),
    "Run {run} halted",
    "Run {run} was halted (by the stability guard after its automatic actions did not recover it, "
    "or by an operator). Its GPUs are idle until a human resumes or abandons it; "
    "playbooks/RunHalted.md says how to resume it for moeguard train, torchtitan and the "
    "transformers Trainer.",
)


def halted_annotations(run: str, info: dict[str, str]) -> dict[str, str]:
    """RunHalted's summary and description when the halt is known (schema.HALT_INFO_LABELS), plus
    one annotation per label. The rule in alerts/moeguard.rules.yml renders the very same text
    from moeguard_run_halt_info (tests/guard/test_halt_page.py renders both), so Alertmanager shows
    the same words whichever source updated the alert last."""
    det = f" ({info['detector']})" if info.get("detector") else ""
    return {
        "summary": f"Run {run} halted at step {info['step']} by {info['halted_by']}{det}",
        "description": (
            f"Run {run} ({info['framework']}) was halted at step {info['step']} by "
            f"{info['halted_by']}{det}: {info['reason']}. Its GPUs are idle until a human resumes or "
            f"abandons it; playbooks/RunHalted.md says how to resume a {info['framework']} run."
        ),
        **{k: info[k] for k in schema.HALT_INFO_LABELS},
    }


REPEATED_NONFINITE = PagedAlert(
    "NonFiniteLoss",
    1800.0,
    2,
    ("run",),
    "Repeated non-finite steps in run {run}",
    "Run {run} produced {count} steps with a NaN/Inf loss or gradient norm in the last 30m: "
    "skipping is not fixing it. Suspect a bad data window, a diverging run or a faulty GPU.",
)
ROLLBACK_STORM = PagedAlert(
    "GuardRollbackStorm",
    3600.0,
    2,
    ("run",),
    "Guard keeps rolling back run {run}",
    "The guard rolled run {run} back {count} times in the last hour; the cause is not a single bad batch.",
)
HARDWARE_FAULT = PagedAlert(
    "SuspectedHardwareFault",
    3600.0,
    1,
    ("run", "rank"),
    "Suspected hardware fault on rank {rank} of run {run}",
    "{count} flagged step(s) of run {run} came out clean when recomputed from the same state in "
    "the last 1h (guard.rerun): a one-off corruption on rank {rank}, not the data. Test or drain "
    "the node that hosts the rank.",
)
PAGED = (RUN_HALTED, REPEATED_NONFINITE, ROLLBACK_STORM, HARDWARE_FAULT)
assert all(p.alertname in schema.ALERTS for p in PAGED)


def alert_labels(alert: PagedAlert, run: str, rank: str | None = None) -> dict[str, str]:
    """The labels of the rule's alert (before Prometheus's external labels)."""
    labels = {"alertname": alert.alertname, "severity": SEVERITY, "scope": alert.scope, "run": run}
    if "rank" in alert.by:
        labels["rank"] = "-1" if rank is None else str(rank)
    return labels


def runbook_url(alertname: str, base: str = "") -> str:
    """As the rules' template: `{{ with $externalLabels.runbook_base }}{{ . }}/{{ end }}playbooks/X.md`."""
    return f"{base}/playbooks/{alertname}.md" if base else f"playbooks/{alertname}.md"


@dataclass(slots=True)
class Firing:
    labels: dict[str, str]
    annotations: dict[str, str]
    starts_at: float


@dataclass(slots=True)
class _Series:
    alert: PagedAlert
    labels: dict[str, str]
    times: deque = field(default_factory=deque)  # signal times within the window (a window alert)
    on: bool = False  # a latch's state
    info: dict[str, str] | None = None  # a latch's labels of what set it (RunHalted: HALT_INFO_LABELS)
    since: float | None = None  # when it started firing


class PageBook:
    """Every paged alert's state, by its label set. Not thread-safe (one owner thread)."""

    def __init__(self) -> None:
        self._series: dict[Key, _Series] = {}

    def _get(self, alert: PagedAlert, run: str, rank: str | None) -> _Series:
        labels = alert_labels(alert, run, rank)
        key = key_of(labels)
        s = self._series.get(key)
        if s is None:
            s = self._series[key] = _Series(alert, labels)
        return s

    def signal(self, alert: PagedAlert, run: str, now: float, rank: str | None = None) -> None:
        """One more occurrence (a window alert)."""
        self._get(alert, run, rank).times.append(now)

    def latch(
        self, alert: PagedAlert, run: str, on: bool, now: float, info: dict[str, str] | None = None
    ) -> None:
        """Set a latch alert's state (a latch never seen on is not created by turning it off);
        `info`: what set it, for the annotations (RunHalted: halted_annotations)."""
        key = key_of(alert_labels(alert, run))
        if on or key in self._series:
            s = self._get(alert, run, None)
            s.on, s.info = on, info

    def latched(self, alert: PagedAlert) -> list[str]:
        """Runs whose `alert` latch is on."""
        return [s.labels["run"] for s in self._series.values() if s.alert is alert and s.on]

    def state_dict(self) -> dict[str, Any]:
        """The window signals (latches are the run's own state, kept by the collector)."""
        return {
            "version": 1,
            "windows": [
                [s.alert.alertname, s.labels["run"], s.labels.get("rank"), list(s.times)]
                for s in self._series.values()
                if s.times
            ],
        }

    def load_state_dict(self, st: dict[str, Any]) -> None:
        """Add `state_dict()`'s windows; ValueError when it is damaged."""
        by_name = {a.alertname: a for a in PAGED if a.window_s > 0}
        try:
            for name, run, rank, times in st.get("windows", []):
                for t in times:
                    self.signal(by_name[name], str(run), float(t), rank)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"paging state: {e!r}") from None

    def firing(self, now: float, runbook_base: str = "") -> dict[Key, Firing]:
        """What fires now; series that neither fire nor hold a signal are forgotten."""
        out: dict[Key, Firing] = {}
        for key, s in list(self._series.items()):
            a = s.alert
            if a.window_s > 0:
                while s.times and s.times[0] <= now - a.window_s:
                    s.times.popleft()
                count, on = len(s.times), len(s.times) >= a.threshold
            else:
                count, on = 1, s.on
            if not on:
                s.since = None
                if not s.times and not s.on:
                    del self._series[key]
                continue
            if s.since is None:
                s.since = now
            fmt = {"run": s.labels["run"], "rank": s.labels.get("rank", ""), "count": count}
            ann = {"summary": a.summary.format(**fmt), "description": a.description.format(**fmt)}
            if a is RUN_HALTED and s.info is not None:
                ann = halted_annotations(s.labels["run"], s.info)
            out[key] = Firing(
                labels=dict(s.labels),
                annotations={**ann, "runbook_url": runbook_url(a.alertname, runbook_base)},
                starts_at=s.since,
            )
        return out


def key_of(labels: dict[str, str]) -> Key:
    return tuple(sorted(labels.items()))
