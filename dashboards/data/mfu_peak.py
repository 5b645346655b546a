"""MFU's peak: which one a run used (meta.json env), and whether a reader can trust and
compare it. Pure: no streamlit, no I/O."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

MFU_LIMIT = 1.0  # MFU above this is not physical: a measurement artefact (a peak that was too low)


PEAK_TABLE = "table"  # GPU datasheet peak matched on the device name (guard/runtime/peak.py)


PEAK_PINNED = "pinned"  # CPU peak pinned per machine class (configs/cpu_peaks.toml)


PEAK_SELF = "self-measured"  # older runs: each run timed a few matmuls at start-up


PEAK_NONE = "none"  # no peak: MFU not computed, tokens/s is the measure


@dataclass(frozen=True, slots=True)
class Peak:
    """The peak FLOP/s a run's MFU was computed against, from meta.json env."""

    flops: float | None
    source: str
    kind: str  # PEAK_*

    @property
    def trusted(self) -> bool:
        """A fixed, documented peak: MFU is bounded by it and comparable between runs that share it."""
        return self.kind in (PEAK_TABLE, PEAK_PINNED) and bool(self.flops)

    def label(self) -> str:
        """'214 GFLOP/s, pinned (cpu-...-2c fp32)' in a few words, for tables and captions."""
        if not self.flops:
            return "no peak: tokens/s only"
        what = {
            PEAK_TABLE: "datasheet",
            PEAK_PINNED: "pinned",
            PEAK_SELF: "self-measured by the run, not comparable",
        }
        detail = ""
        if self.kind == PEAK_PINNED:  # "pinned: <class> <dtype> in <file>, measured ..."
            detail = " (" + " ".join(self.source.removeprefix("pinned:").split(",")[0].split()[:2]) + ")"
        elif self.kind == PEAK_TABLE:  # "table: H100 SXM bf16 dense ('NVIDIA ...')"
            detail = " (" + self.source.split(":", 1)[1].split("(")[0].strip() + ")"
        return f"{fmt_flops(self.flops)}, {what.get(self.kind, self.kind)}{detail}"

    def short(self) -> str:
        """'214 GFLOP/s pinned' for a table cell (label() and source say the rest)."""
        if not self.flops:
            return "none"
        return f"{fmt_flops(self.flops)} {'self-measured' if self.kind == PEAK_SELF else self.kind}"

    def cell(self) -> str:
        """'214 GFLOP/s pinned', '16 GFLOP/s self': short() narrower, for a table cell (units
        always: a bare '214 G' read as a count)."""
        if not self.flops:
            return "none"
        kind = "self" if self.kind == PEAK_SELF else self.kind
        return f"{fmt_flops(self.flops)} {kind}"


def fmt_flops(v: float) -> str:
    for unit, n in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if v >= n:
            return f"{v / n:.3g} {unit}"
    return f"{v:.3g} FLOP/s"


def run_peak(env: dict[str, Any]) -> Peak:
    flops = env.get("peak_flops")
    flops = float(flops) if isinstance(flops, int | float) and math.isfinite(flops) and flops > 0 else None
    source = str(env.get("peak_flops_source") or "")
    low = source.lower()
    if flops is None:
        kind = PEAK_NONE
    elif low.startswith("table"):
        kind = PEAK_TABLE
    elif low.startswith("pinned"):
        kind = PEAK_PINNED
    elif low.startswith("measured") or "probe" in low:
        kind = PEAK_SELF
    else:
        kind = PEAK_SELF  # a peak we cannot place is not one to trust
    return Peak(flops, source or "not recorded", kind)


def mfu_note(mfu: float | None, peak: Peak) -> str:
    """What a reader must know next to one MFU figure ("" when nothing)."""
    if mfu is not None and mfu > MFU_LIMIT:
        return "above 100%: a measurement artefact (the peak used is too low), not a real MFU"
    if peak.kind == PEAK_SELF:
        return "peak self-measured by the run: compare tokens/s instead"
    return ""


def fmt_flops_per_token(v: float) -> str:
    for unit, n in (("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if v >= n:
            return f"{v / n:.3g} {unit}/token"
    return f"{v:.3g} FLOP/token"


def formula(flops_per_token: Any, world: Any, peak: Peak) -> str:
    """What the run's MFU divides by what, with its own numbers (the MFU chart's caption).

    MFU of one model on one device is comparable; across models it is not a measure of the code:
    a tiny model's small matmuls reach a few % of a CPU's peak where one 2x wider, with 9x the
    FLOPs per token, reaches ~4x that (docs/NOTES.md "## App")."""
    fpt = float(flops_per_token) if isinstance(flops_per_token, int | float) else math.nan
    ranks = int(world) if isinstance(world, int) and world > 0 else 1
    what = (
        f"{fmt_flops_per_token(fpt)} (analytic: 6 x the active matmul parameters + attention, "
        "meta.json flops_per_token)"
        if math.isfinite(fpt) and fpt > 0
        else "FLOPs per token (not recorded for this run)"
    )
    rank_s = f"{ranks} rank" + ("s" if ranks != 1 else "")
    return (
        f"MFU = {what} x tokens/s / ({peak.label()} x {rank_s}); peak source: {peak.source}. "
        "A step's time runs from one optimizer decision to the next (the whole step). "
        "MFU depends on the model's matmul sizes (a small model's use a small share of the peak): "
        "between runs of different models it does not compare the loops."
    )
