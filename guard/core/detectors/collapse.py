"""MoE routing collapse: dead experts, sustained MaxVio, low load or router entropy, per layer.

Sustained means the same experts stay hot: MaxVio and load entropy fire when each step of the
window is past the line AND the window's loads pooled are too. A router that sends each batch to
a different few experts (LongCat-Flash's tiny build, issue #28: layer 1's per-step MaxVio 2.9 of a
largest 4.0 at 90% of its steps, 0.44 over any 10 steps pooled) is concentrated per batch and
balanced over time: a selection bias or a balancing gradient corrects a lasting preference, which
it does not have, so acting on it only escalated a clean run to rollbacks and a halt. Its per-step
figures stay in the steps table and the app; no verdict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from guard.core import schema
from guard.core.config import CollapseConfig
from guard.core.events import Verdict
from guard.core.report import StepReport
from guard.core.routing_stats import maxvio_and_entropy

# Dead-expert evidence lists at most this many expert ids (a 256-expert layer stays readable).
_MAX_IDS = 32


@dataclass(slots=True)
class _LayerRouting:
    """Per-MoE-layer counters: how long each condition has held."""

    since_token_E: np.ndarray  # steps since each expert last got a token
    # the loads of the current run of steps past a sustained line (at most the longest window)
    recent_TE: list[np.ndarray] = field(default_factory=list)
    maxvio_for: int = 0
    load_entropy_for: int = 0
    router_entropy_for: int = 0

    def dead(self, window: int) -> np.ndarray:
        return np.flatnonzero(self.since_token_E >= window)

    def pooled(self, steps: int) -> tuple[float, float]:
        """(MaxVio, load entropy) of the loads summed over the last `steps` kept steps."""
        mv_1, h_1 = maxvio_and_entropy(np.sum(self.recent_TE[-steps:], axis=0)[None, :])
        return float(mv_1[0]), float(h_1[0])


class CollapseDetector:
    """Routing health per MoE layer: dead experts, sustained MaxVio, low load/router entropy.

    Verdicts are level-triggered: while a condition holds, every update returns its verdict,
    so the policy sees an uncorrected collapse every step and `healthy()` agrees with them.
    """

    def __init__(self, cfg: CollapseConfig) -> None:
        self.cfg = cfg
        self.n_updates = 0
        self.layers: dict[int, _LayerRouting] = {}

    def update(self, report: StepReport) -> list[Verdict]:
        """Fired verdicts for this step (layer set); none before `warmup` updates."""
        cfg = self.cfg
        self.n_updates += 1
        ids = [int(i) for i in report.moe_layer_ids_M]
        loads = report.load_ME
        have_loads = loads.ndim == 2 and loads.shape[0] == len(ids) and loads.shape[1] > 0
        states = [self._layer(lid, loads.shape[1] if have_loads else 0) for lid in ids]
        judging = self.n_updates > cfg.warmup  # routing is chaotic at init; counters run, verdicts wait
        n_dead_M: list[int | None] = [None] * len(ids)
        if have_loads and ids:
            # All layers in a few array operations (not a handful per layer): each layer's row
            # of steps-since-a-token, and its dead count where verdicts are due.
            since_ME = np.where(loads > 0, 0, np.stack([st.since_token_E for st in states]) + 1)
            for st, row in zip(states, since_ME, strict=True):
                st.since_token_E = row
            if judging:
                n_dead_M = (since_ME >= cfg.dead_window).sum(axis=1).tolist()
        out: list[Verdict] = []
        maxvio_M, load_h_M, router_h_M = (
            report.maxvio_M.tolist(),
            report.load_entropy_M.tolist(),
            report.router_entropy_M.tolist(),
        )
        keep = max(cfg.maxvio_for, cfg.entropy_for)
        for i, (lid, st) in enumerate(zip(ids, states, strict=True)):
            maxvio, load_h, router_h = float(maxvio_M[i]), float(load_h_M[i]), float(router_h_M[i])
            # NaN compares False: an unknown value ends a run rather than extending it.
            st.maxvio_for = st.maxvio_for + 1 if maxvio > cfg.maxvio else 0
            st.load_entropy_for = st.load_entropy_for + 1 if load_h < cfg.load_entropy_floor else 0
            if st.maxvio_for or st.load_entropy_for:  # only a run past a line needs its loads
                if have_loads:
                    st.recent_TE = [*st.recent_TE[-(keep - 1) :], np.asarray(loads[i], dtype=np.float64)]
            else:
                st.recent_TE = []
            low_router = cfg.router_entropy_floor > 0 and router_h < cfg.router_entropy_floor
            st.router_entropy_for = st.router_entropy_for + 1 if low_router else 0
            if not judging:
                continue
            # Without per-expert loads this step, trust the reporter's own dead count.
            n_dead = n_dead_M[i] if have_loads else int(report.dead_experts_M[i])
            out.extend(self._verdicts(lid, st, maxvio, load_h, router_h, n_dead))
        return out

    def _layer(self, lid: int, n_exp: int) -> _LayerRouting:
        """The layer's counters (created on first sight; its expert window restarted when the
        expert count changed)."""
        st = self.layers.get(lid)
        if st is None:
            st = self.layers[lid] = _LayerRouting(np.zeros(n_exp, dtype=np.int64))
        elif n_exp and st.since_token_E.shape != (n_exp,):
            st.since_token_E = np.zeros(n_exp, dtype=np.int64)
        return st

    def _verdicts(
        self,
        lid: int,
        st: _LayerRouting,
        maxvio: float,
        load_h: float,
        router_h: float,
        n_dead: int | None,
    ) -> list[Verdict]:
        cfg = self.cfg
        out = []
        n_exp = st.since_token_E.size
        if n_exp and n_dead is not None:
            if n_dead / n_exp > cfg.max_dead_frac:
                dead_ids = st.dead(cfg.dead_window)
                out.append(
                    Verdict(
                        detector=schema.DET_DEAD_EXPERTS,
                        fired=True,
                        value=n_dead / n_exp,
                        threshold=cfg.max_dead_frac,
                        layer=lid,
                        evidence={
                            "dead": n_dead,
                            "experts": n_exp,
                            "window": cfg.dead_window,
                            "dead_ids": dead_ids[:_MAX_IDS].tolist(),
                        },
                    )
                )
        # Sustained signals: (detector, value, threshold, steps past it so far, steps needed).
        sustained = (
            (schema.DET_MAXVIO, maxvio, cfg.maxvio, st.maxvio_for, cfg.maxvio_for),
            (schema.DET_LOAD_ENTROPY, load_h, cfg.load_entropy_floor, st.load_entropy_for, cfg.entropy_for),
            (
                schema.DET_ROUTER_ENTROPY,
                router_h,
                cfg.router_entropy_floor,
                st.router_entropy_for,
                cfg.entropy_for,
            ),
        )
        for detector, value, threshold, run, needed in sustained:
            if run < needed:
                continue
            evidence: dict[str, Any] = {"for": run}
            if detector in (schema.DET_MAXVIO, schema.DET_LOAD_ENTROPY) and len(st.recent_TE) >= needed:
                pooled_mv, pooled_h = st.pooled(needed)
                if detector == schema.DET_MAXVIO and not pooled_mv > threshold:
                    continue  # concentrated per batch, balanced over the window: no lasting preference
                if detector == schema.DET_LOAD_ENTROPY and not pooled_h < threshold:
                    continue
                evidence["pooled"] = round(pooled_mv if detector == schema.DET_MAXVIO else pooled_h, 4)
            out.append(
                Verdict(
                    detector=detector,
                    fired=True,
                    value=value,
                    threshold=threshold,
                    layer=lid,
                    evidence=evidence,
                )
            )
        return out

    def reset_layer(self, layer: int) -> None:
        """Restart every window of `layer` (after a correction, so old evidence does not re-fire)."""
        st = self.layers.get(int(layer))
        if st is not None:
            st.since_token_E = np.zeros_like(st.since_token_E)
            st.maxvio_for = st.load_entropy_for = st.router_entropy_for = 0
            st.recent_TE = []

    def healthy(self, layer: int) -> bool:
        """No condition holds now on `layer`: few enough dead experts, router entropy in bounds, and
        MaxVio and load entropy in bounds on the last step or, past a line, over the run of steps
        past it (the pooled rule the verdicts use).

        A layer never seen is healthy (nothing is known against it).
        """
        st = self.layers.get(int(layer))
        if st is None:
            return True
        cfg = self.cfg
        n_exp = st.since_token_E.size
        dead_ok = n_exp == 0 or len(st.dead(cfg.dead_window)) / n_exp <= cfg.max_dead_frac
        if not dead_ok or st.router_entropy_for:
            return False
        if not (st.maxvio_for or st.load_entropy_for):
            return True
        # Past a line on this step: healthy only where the verdicts' own pooled rule would not
        # fire (a layer that sends each batch to a few experts but none for long is not
        # collapsed; judging it by the last step alone rolled back healthy LongCat-Flash layers)
        if not st.recent_TE:
            return False
        pooled_mv, pooled_h = st.pooled(max(st.maxvio_for, st.load_entropy_for))
        return not pooled_mv > cfg.maxvio and not pooled_h < cfg.load_entropy_floor

    def state_dict(self) -> dict[str, Any]:
        return {
            "n_updates": self.n_updates,
            "layers": {
                str(k): {
                    "since_token_E": st.since_token_E.tolist(),
                    "maxvio_for": st.maxvio_for,
                    "load_entropy_for": st.load_entropy_for,
                    "router_entropy_for": st.router_entropy_for,
                    "recent_TE": [r.tolist() for r in st.recent_TE],
                }
                for k, st in sorted(self.layers.items())
            },
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.n_updates = int(d.get("n_updates", 0))
        self.layers = {
            int(k): _LayerRouting(
                np.asarray(s["since_token_E"], dtype=np.int64),
                # a state saved before the pooled check: the run's loads refill from the next step
                [np.asarray(r, dtype=np.float64) for r in s.get("recent_TE", [])],
                int(s["maxvio_for"]),
                int(s["load_entropy_for"]),
                int(s["router_entropy_for"]),
            )
            for k, s in d.get("layers", {}).items()
        }
