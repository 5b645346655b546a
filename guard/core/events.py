"""Verdicts (what a detector saw) and Events (what lands in the run store's `events` table)."""

from __future__ import annotations

import json
import time as _time
from dataclasses import dataclass, field
from typing import Any

from guard.core import schema


@dataclass(kw_only=True, slots=True)
class Verdict:
    """A detector's finding for one step. `fired` False means "all clear"."""

    detector: str
    fired: bool
    value: float = float("nan")
    threshold: float = float("nan")
    layer: int | None = None
    severity: str = "warning"  # warning | critical
    evidence: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def ok(cls, detector: str) -> Verdict:
        return cls(detector=detector, fired=False)


@dataclass(kw_only=True, slots=True)
class Event:
    step: int
    kind: str
    detector: str = ""
    value: float = float("nan")
    threshold: float = float("nan")
    action: str = schema.ACT_NONE
    detail: dict[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=_time.time)

    def row(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "time": self.time,
            "kind": self.kind,
            "detector": self.detector,
            "value": float(self.value),
            "threshold": float(self.threshold),
            "action": self.action,
            "detail": json.dumps(self.detail, default=_json_default, sort_keys=True),
        }

    @classmethod
    def from_verdict(cls, step: int, v: Verdict, action: str) -> Event:
        detail = dict(v.evidence)
        if v.layer is not None:
            detail["layer"] = v.layer
        detail["severity"] = v.severity
        return cls(
            step=step,
            kind=schema.EV_VERDICT,
            detector=v.detector,
            value=v.value,
            threshold=v.threshold,
            action=action,
            detail=detail,
        )


def _json_default(o: Any) -> Any:
    try:
        return o.item()  # numpy / torch scalars
    except AttributeError:
        return str(o)
