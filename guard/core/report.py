"""StepReport: everything one training step tells moeguard, host-side, after ONE copy.

Shapes (suffix legend): L = transformer layers, M = MoE layers, E = experts per MoE layer.
The trainer builds it from a single device->host transfer; the exporter ships it as JSON;
the collector rebuilds it; detectors, the run store and replay all consume the same object.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from guard.core import schema


@dataclass(kw_only=True, slots=True)
class StepReport:
    step: int
    time: float
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    step_time_s: float = float("nan")
    data_wait_s: float = float("nan")
    tokens_per_s: float = float("nan")
    mfu: float = float("nan")
    mem_peak_bytes: int = 0
    action: str = schema.ACT_APPLY
    rank: int = 0
    # this rank's straggler score (fastest rank's median busy step time / this rank's) from the
    # trainer's last straggler window; NaN when unknown (single rank, or before the first window)
    straggler_score: float = float("nan")
    # per layer (L): index into the model's blocks
    layer_ids_L: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    layer_grad_norm_L: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # per MoE layer (M), aligned with moe_layer_ids_M
    moe_layer_ids_M: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    router_entropy_M: np.ndarray = field(default_factory=lambda: np.zeros(0))
    load_entropy_M: np.ndarray = field(default_factory=lambda: np.zeros(0))
    maxvio_M: np.ndarray = field(default_factory=lambda: np.zeros(0))
    dead_experts_M: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    bias_norm_M: np.ndarray = field(default_factory=lambda: np.zeros(0))
    load_ME: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    bias_ME: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))

    # ---- derived -------------------------------------------------------------------
    @property
    def finite(self) -> bool:
        """False when the loss or any gradient norm is NaN/Inf."""
        vals = [self.loss, self.grad_norm]
        return all(math.isfinite(v) for v in vals) and bool(np.isfinite(self.layer_grad_norm_L).all())

    def n_values(self) -> int:
        """Numeric values carried (for ingest accounting)."""
        return (
            11
            + 2 * self.layer_grad_norm_L.size
            + 6 * self.router_entropy_M.size
            + self.load_ME.size
            + self.bias_ME.size
        )

    # ---- run-store rows ------------------------------------------------------------
    def steps_row(self) -> dict[str, Any]:
        return {c: getattr(self, c) for c in schema.STEPS_COLUMNS}

    def layer_rows(self) -> dict[str, list]:
        """Columns for the `layers` table: one row per transformer layer (see layer_columns)."""
        return {c: v.tolist() for c, v in layer_columns([self]).items()}

    def expert_rows(self) -> dict[str, list]:
        return {c: v.tolist() for c, v in expert_columns([self]).items()}

    # ---- wire format ---------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self.__slots__:  # type: ignore[attr-defined]
            v = getattr(self, name)
            out[name] = v.tolist() if isinstance(v, np.ndarray) else v
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StepReport:
        """Rebuild from `to_json`; raises ValueError naming the bad field."""
        kwargs: dict[str, Any] = {}
        for name in cls.__slots__:  # type: ignore[attr-defined]
            if name not in d:
                if name in _REQUIRED:
                    raise ValueError(f"missing field {name!r}")
                continue
            v = d[name]
            try:
                if name in _ARRAY_DTYPES:
                    arr = np.asarray(v if v is not None else [], dtype=_ARRAY_DTYPES[name])
                    if name.endswith("_ME") and arr.size == 0:
                        arr = arr.reshape(0, 0)
                    kwargs[name] = arr
                elif name in ("step", "tokens", "mem_peak_bytes", "rank"):
                    if isinstance(v, bool) or not isinstance(v, int):
                        raise TypeError
                    kwargs[name] = int(v)
                elif name == "action":
                    if v not in schema.ACTIONS:
                        raise ValueError(f"field 'action': {v!r} not one of {schema.ACTIONS}")
                    kwargs[name] = v
                else:
                    kwargs[name] = float("nan") if v is None else float(v)
            except (TypeError, ValueError, OverflowError) as e:
                if isinstance(e, ValueError) and str(e).startswith("field"):
                    raise
                raise ValueError(f"field {name!r}: bad value {str(v)[:60]!r}") from None
        rep = cls(**kwargs)
        rep.validate()
        return rep

    def validate(self) -> None:
        """Check array shapes agree; raises ValueError saying which."""
        n_l = len(self.layer_ids_L)
        if self.layer_grad_norm_L.shape != (n_l,):
            raise ValueError(f"layer_grad_norm_L has shape {self.layer_grad_norm_L.shape}, expected ({n_l},)")
        m = len(self.moe_layer_ids_M)
        for name in ("router_entropy_M", "load_entropy_M", "maxvio_M", "dead_experts_M", "bias_norm_M"):
            arr = getattr(self, name)
            if arr.shape != (m,):
                raise ValueError(f"{name} has shape {arr.shape}, expected ({m},)")
        if m and (self.load_ME.ndim != 2 or self.load_ME.shape[0] != m):
            raise ValueError(f"load_ME has shape {self.load_ME.shape}, expected ({m}, E)")
        if self.bias_ME.size and self.bias_ME.shape != self.load_ME.shape:
            raise ValueError(f"bias_ME has shape {self.bias_ME.shape}, expected {self.load_ME.shape}")
        if self.step < 0:
            raise ValueError(f"step must be >= 0, got {self.step}")


# Per-MoE-layer statistics stored per layer row, with the value a dense layer (no router) gets.
_ROUTING_STATS = (
    ("router_entropy", "router_entropy_M", math.nan),
    ("load_entropy", "load_entropy_M", math.nan),
    ("maxvio", "maxvio_M", math.nan),
    ("dead_experts", "dead_experts_M", 0),
    ("bias_norm", "bias_norm_M", math.nan),
)


def layer_columns(reps: list[StepReport]) -> dict[str, np.ndarray]:
    """Columns for the `layers` table from many reports at once: one row per (step, transformer
    layer). Dense layers carry NaN routing statistics (0 dead experts). Reports that share one
    layout (the usual case) are converted with a handful of array operations in total."""
    reps = [r for r in reps if len(r.layer_ids_L)]
    if not reps:
        return {c: np.zeros(0) for c in schema.LAYERS_COLUMNS}
    n = np.array([len(r.layer_ids_L) for r in reps])
    cols: dict[str, np.ndarray] = {
        "step": np.repeat(np.array([r.step for r in reps], dtype=np.int64), n),
        "layer": np.concatenate([r.layer_ids_L for r in reps]).astype(np.int64),
        "grad_norm": np.concatenate([r.layer_grad_norm_L for r in reps]).astype(np.float64),
    }
    first = reps[0]
    same_layout = all(
        np.array_equal(r.layer_ids_L, first.layer_ids_L)
        and np.array_equal(r.moe_layer_ids_M, first.moe_layer_ids_M)
        for r in reps
    )
    for col, attr, fill in _ROUTING_STATS:
        if same_layout:
            dst, src = _moe_positions(first)
            out = np.full((len(reps), len(first.layer_ids_L)), fill, dtype=np.float64)
            if dst.size:
                out[:, dst] = np.stack([np.asarray(getattr(r, attr), dtype=np.float64) for r in reps])[:, src]
            cols[col] = out.reshape(-1)
        else:
            parts = []
            for r in reps:
                dst, src = _moe_positions(r)
                row = np.full(len(r.layer_ids_L), fill, dtype=np.float64)
                row[dst] = np.asarray(getattr(r, attr), dtype=np.float64)[src]
                parts.append(row)
            cols[col] = np.concatenate(parts)
    cols["dead_experts"] = cols["dead_experts"].astype(np.int64)
    return cols


def _moe_positions(r: StepReport) -> tuple[np.ndarray, np.ndarray]:
    """(positions in layer_ids_L, positions in moe_layer_ids_M) of the MoE layers the report lists."""
    where = {int(lid): i for i, lid in enumerate(r.layer_ids_L)}
    pairs = [(where[int(lid)], j) for j, lid in enumerate(r.moe_layer_ids_M) if int(lid) in where]
    return np.array([d for d, _ in pairs], dtype=np.int64), np.array([s for _, s in pairs], dtype=np.int64)


def expert_columns(reps: list[StepReport]) -> dict[str, np.ndarray]:
    """Columns for the `experts` table from many reports: one row per (step, MoE layer, expert)."""
    reps = [r for r in reps if r.load_ME.ndim == 2 and r.load_ME.size]
    if not reps:
        return {c: np.zeros(0) for c in schema.EXPERTS_COLUMNS}
    sizes = np.array([r.load_ME.size for r in reps])
    return {
        "step": np.repeat(np.array([r.step for r in reps], dtype=np.int64), sizes),
        "layer": np.concatenate(
            [np.repeat(r.moe_layer_ids_M.astype(np.int64), r.load_ME.shape[1]) for r in reps]
        ),
        "expert": np.concatenate([np.tile(np.arange(r.load_ME.shape[1]), r.load_ME.shape[0]) for r in reps]),
        "load": np.concatenate([r.load_ME.reshape(-1) for r in reps]).astype(np.int64),
        "bias": np.concatenate(
            [r.bias_ME.reshape(-1) if r.bias_ME.size else np.zeros(r.load_ME.size) for r in reps]
        ).astype(np.float64),
    }


_REQUIRED = ("step", "time", "loss", "grad_norm", "lr", "tokens")
_ARRAY_DTYPES = {
    "layer_ids_L": np.int32,
    "layer_grad_norm_L": np.float64,
    "moe_layer_ids_M": np.int32,
    "router_entropy_M": np.float64,
    "load_entropy_M": np.float64,
    "maxvio_M": np.float64,
    "dead_experts_M": np.int32,
    "bias_norm_M": np.float64,
    "load_ME": np.int64,
    "bias_ME": np.float64,
}
