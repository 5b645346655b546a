"""StepReport: everything one training step tells moeguard, host-side, after ONE copy.

Shapes (suffix legend): L = transformer layers, M = MoE layers, E = experts per MoE layer,
G = optimizer parameter groups.
The trainer builds it from a single device->host transfer; the exporter ships it as JSON;
the collector rebuilds it; detectors, the run store and replay all consume the same object.
Its one mapping to and from run-store table rows is guard/core/rows.py.
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
    # precursors (guard/runtime/precursor.py): the relative size of the update that produced this
    # step's weights, ||W_t - W_{t-1}|| / ||W_{t-1}||, in total; NaN when no update was applied or
    # measured. Adam's second-moment spike ratio (NaN when off).
    update_ratio: float = float("nan")
    adam_v_ratio: float = float("nan")
    # max attention logit over every watched layer (guard/runtime/attention_logits.py); NaN on
    # steps it was not sampled (every PrecursorConfig.max_logit_every-th step) or not watched
    max_logit: float = float("nan")
    # per layer (L): index into the model's blocks
    layer_ids_L: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    layer_grad_norm_L: np.ndarray = field(default_factory=lambda: np.zeros(0))
    update_ratio_L: np.ndarray = field(default_factory=lambda: np.zeros(0))  # empty: not measured
    max_logit_L: np.ndarray = field(default_factory=lambda: np.zeros(0))  # empty: not measured
    # per MoE layer (M), aligned with moe_layer_ids_M
    moe_layer_ids_M: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    router_entropy_M: np.ndarray = field(default_factory=lambda: np.zeros(0))
    load_entropy_M: np.ndarray = field(default_factory=lambda: np.zeros(0))
    maxvio_M: np.ndarray = field(default_factory=lambda: np.zeros(0))
    dead_experts_M: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    bias_norm_M: np.ndarray = field(default_factory=lambda: np.zeros(0))
    load_ME: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    bias_ME: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    # per optimizer parameter group (G, index into optimizer.param_groups); empty: not measured
    group_grad_norm_G: np.ndarray = field(default_factory=lambda: np.zeros(0))
    group_update_ratio_G: np.ndarray = field(default_factory=lambda: np.zeros(0))

    # ---- derived -------------------------------------------------------------------
    @property
    def finite(self) -> bool:
        """False when the loss or any gradient norm is NaN/Inf."""
        vals = [self.loss, self.grad_norm]
        return all(math.isfinite(v) for v in vals) and bool(np.isfinite(self.layer_grad_norm_L).all())

    def n_values(self) -> int:
        """Numeric values carried (for ingest accounting)."""
        return (
            13
            + 2 * self.layer_grad_norm_L.size
            + self.update_ratio_L.size
            + self.max_logit_L.size
            + 2 * self.group_grad_norm_G.size
            + 6 * self.router_entropy_M.size
            + self.load_ME.size
            + self.bias_ME.size
        )

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
                    if not 0 <= v <= INT64_MAX:  # a count; the stored column is Int64
                        raise ValueError(f"field {name!r}: {str(v)[:30]} is not in [0, 2**63 - 1]")
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
        if self.update_ratio_L.size and self.update_ratio_L.shape != (n_l,):
            raise ValueError(
                f"update_ratio_L has shape {self.update_ratio_L.shape}, expected ({n_l},) or (0,)"
            )
        if self.max_logit_L.size and self.max_logit_L.shape != (n_l,):
            raise ValueError(f"max_logit_L has shape {self.max_logit_L.shape}, expected ({n_l},) or (0,)")
        n_g = self.group_grad_norm_G.size
        if self.group_update_ratio_G.size and self.group_update_ratio_G.shape != (n_g,):
            raise ValueError(
                f"group_update_ratio_G has shape {self.group_update_ratio_G.shape}, expected ({n_g},) or (0,)"
            )
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


INT64_MAX = (1 << 63) - 1  # integer fields are stored as Int64

_REQUIRED = ("step", "time", "loss", "grad_norm", "lr", "tokens")
_ARRAY_DTYPES = {
    "layer_ids_L": np.int32,
    "layer_grad_norm_L": np.float64,
    "update_ratio_L": np.float64,
    "max_logit_L": np.float64,
    "moe_layer_ids_M": np.int32,
    "router_entropy_M": np.float64,
    "load_entropy_M": np.float64,
    "maxvio_M": np.float64,
    "dead_experts_M": np.int32,
    "bias_norm_M": np.float64,
    "load_ME": np.int64,
    "bias_ME": np.float64,
    "group_grad_norm_G": np.float64,
    "group_update_ratio_G": np.float64,
}
