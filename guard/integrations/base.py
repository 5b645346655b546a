"""The contract between the guard and a model moeguard did not write.

An adapter (one module per framework: `transformers.py`, `torchtitan.py`) finds the MoE layers
of a model and returns an `Attachment`:

    layers      the repeated blocks, for per-layer gradient norms
    routers     (layer id, RoutingSource) per MoE layer: what the model's router CHOSE, counted
                on the device (never re-derived from logits: grouped routing, selection biases
                and renormalisation differ per family and a re-derivation gets them wrong)
    corrector   how a collapse is corrected on this model, or None when it cannot be

Shapes: N tokens, E experts, K top-k, M MoE layers.

A RoutingSource exposes device tensors the Probe reads once per step (no host sync here):
tokens_per_expert_E (float), entropy_sum (sum over tokens of the router's score entropy, nats),
token_count (the tokens entropy_sum summed over: their ratio is the mean entropy), expert_bias_E
(the selection bias, zeros when the model has none) and reset_stats().

Correctors (the decision's boost per layer is applied by whoever owns the step, here the
adapter; an action that cannot be applied is never reported as done):
  BiasCorrector     models with a selection-only bias (DeepSeek-V3's e_score_correction_bias,
                    afmoe's expert_bias, torchtitan's expert_bias_E): a bounded, mean-centred SMEBU
                    push on the collapsing layer's bias while the correction is open; the model's
                    own bias update (if any) keeps running untouched, or, for models that have
                    none (transformers), the corrector runs one (`update`: sign or SMEBU).
  AuxGradCorrector  models balanced by an aux loss only (Mixtral, Qwen-MoE, OLMoE, GPT-OSS): the
                    gradient of a switch-style balancing loss for the collapsing layer alone is
                    added to that layer's router logits during backward, i.e. a per-layer aux-loss
                    boost that needs no change to the user's loss, plus the load-shift gradient on
                    the router's weight (LoadShift) and, on a softmax (logits, weights, ids)
                    router, a bounded per-expert bias on that layer's logits (LogitBias: the
                    aux-loss-free push of DeepSeek-V3 / SMEBU, for a family that has no bias of
                    its own), which acts on the next forward instead of through the optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

# the pushes on a bias-free router, in their own module; imported here as they always were
from guard.integrations.router_push import LoadShift as LoadShift
from guard.integrations.router_push import LogitBias as LogitBias
from guard.integrations.router_push import load_shift_grad_W as load_shift_grad_W

# Moved to guard/runtime/routing.py (the runtime must not import an adapter); re-exported here.
from guard.runtime.routing import ENTROPY_TOKENS as ENTROPY_TOKENS
from guard.runtime.routing import Corrector as Corrector
from guard.runtime.routing import CountedBatch as CountedBatch
from guard.runtime.routing import RoutingCounters as RoutingCounters
from guard.runtime.routing import RoutingSource as RoutingSource
from guard.runtime.routing import count_pending as count_pending
from guard.runtime.routing import counted_together as counted_together
from guard.runtime.routing import score_entropy_sum as score_entropy_sum

MODE_BIAS = "bias"
MODE_AUX = "aux_loss"
MODE_NONE = "none"


def switch_loss_grad(logits_NE: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """d/dlogits of the switch balancing loss E * sum_e f_e * mean_t softmax(logits)_te, with
    f = this forward's assignment shares (constants, as in the Switch Transformer)."""
    x = logits_NE.detach().float()
    n, e = x.shape
    p = x.softmax(-1)
    f_E = counts_E.float() / counts_E.sum().clamp_min(1.0)
    return (e / max(n, 1)) * p * (f_E - (p @ f_E).unsqueeze(-1))


def smebu_push(
    bias_E: torch.Tensor,
    load_E: torch.Tensor,
    *,
    lam: float,
    kappa: float = 2.0,
    bias_max: float | None = None,
) -> None:
    """One bounded balancing step on a selection bias, in place: d = lam * tanh(kappa * v),
    v = (mean - n) / mean, mean-centred (Trinity's SMEBU without momentum, which would carry the
    push past the end of the correction), then clamped to |b| <= bias_max."""
    n_E = load_E.detach().to(bias_E.device, torch.float32)
    mean = n_E.mean().clamp_min(1e-12)
    d_E = lam * torch.tanh(kappa * (mean - n_E) / mean)
    bias_E.add_((d_E - d_E.mean()).to(bias_E.dtype))
    if bias_max is not None:
        bias_E.clamp_(-bias_max, bias_max)


class _Counted:
    """A TopKRoutingHook accumulator: stored as `_<name>`, read through the hook's `_read` (which
    counts its pending forwards first)."""

    names: list[str] = []  # the private attributes of every accumulator

    def __set_name__(self, owner: type, name: str) -> None:
        self.attr = f"_{name}"
        _Counted.names.append(self.attr)

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else obj._read(self.attr)

    def __set__(self, obj: Any, value: torch.Tensor) -> None:
        setattr(obj, self.attr, value)


class TopKRoutingHook(RoutingCounters):
    """A RoutingSource fed by a forward hook on a router module whose output holds the logits
    and the top-k indices the model chose, e.g. transformers 5's `(logits, weights, indices)`.

    Counts come from the indices (bincount, on the device); the entropy from the logits. The hook
    only keeps (detached) references to both: the arithmetic runs when the accumulators are read,
    batched over every layer's hook by `count_pending` (the Probe calls it once per step), so the
    forward pays a reference per layer instead of ~14 small kernels. The logits are small ([N, E])
    and the model keeps them for its own aux loss anyway. When an AuxGradCorrector arms the hook
    (`aux_coef > 0`), the forward counts that layer at once (its gradient hook needs the counts)
    and registers a gradient hook on the logits that adds aux_coef x the switch loss gradient.
    """

    def __init__(
        self,
        router: nn.Module,
        *,
        n_experts: int,
        logits_index: int = 0,
        indices_index: int = 2,
        score_func: str = "softmax",
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__(router, n_experts)
        self.router = router
        self.logits_index = logits_index
        self.indices_index = indices_index
        self.score_func = score_func
        self._bias = bias
        self.has_selection_bias = bias is not None  # else expert_bias_E is always zeros
        self._no_bias_E = torch.zeros_like(self._tokens_per_expert_E)
        self.aux_coef = 0.0
        self.shift: LoadShift | None = None  # armed by an AuxGradCorrector while a correction is open
        self._zeroed = False  # the accumulators hold nothing since reset_stats (not yet zero-filled)
        # (batch, row): the accumulators are that row of a CountedBatch, not yet taken as views
        self.counted: tuple[CountedBatch, int] | None = None
        self.pending: list[
            tuple[torch.Tensor, torch.Tensor]
        ] = []  # (logits [N,E], indices [N*K]) not yet counted

    # The accumulators, brought up to date (pending forwards counted) on every read.
    tokens_per_expert_E = _Counted()
    entropy_sum = _Counted()
    token_count = _Counted()

    @property
    def expert_bias_E(self) -> torch.Tensor:
        # A property: some models replace their bias buffer (to(), load_state_dict(assign=True)).
        return self._bias if self._bias is not None else self._no_bias_E

    def reset_stats(self) -> None:
        # No kernels: the next count_pending assigns its results instead of adding them.
        self.pending.clear()
        self.counted = None
        self._zeroed = True

    def take_counted_row(self) -> None:
        """Make the accumulators views of this hook's row of its CountedBatch (before a read or
        an add)."""
        if self.counted is not None:
            batch, j = self.counted
            self._tokens_per_expert_E, self._entropy_sum = batch.counts_GE[j], batch.ent_G[j]
            self._token_count = batch.ent_G.new_tensor(float(batch.n_tokens))
            self.counted = None

    def _read(self, attr: str) -> torch.Tensor:
        count_pending([self])
        self.take_counted_row()
        if self._zeroed:  # read with nothing counted since the reset
            for name in _Counted.names:
                getattr(self, name).zero_()
            self._zeroed = False
        return getattr(self, attr)

    def _hook(self, module: nn.Module, inputs: Any, output: Any) -> None:
        if not isinstance(output, tuple | list) or len(output) <= max(self.logits_index, self.indices_index):
            raise TypeError(
                f"{type(module).__name__} returned {type(output).__name__}; expected a tuple with "
                f"logits at {self.logits_index} and top-k indices at {self.indices_index}"
            )
        logits, idx = output[self.logits_index], output[self.indices_index]
        if idx.dtype.is_floating_point or logits.shape[-1] != self.n_experts:
            raise TypeError(
                f"{type(module).__name__}: output[{self.indices_index}] is not integer indices or "
                f"output[{self.logits_index}] has {logits.shape[-1]} != {self.n_experts} experts"
            )
        self.record(logits, idx)

    def record(self, logits: torch.Tensor, idx: torch.Tensor) -> None:
        """One forward's routing: the router's logits [..., E] and the expert ids it chose (any
        shape; ids outside 0..E-1 are not counted). Arms the balancing gradient when asked."""
        logits_NE = logits.detach().reshape(-1, self.n_experts)
        self.pending.append((logits_NE, idx.detach().reshape(-1)))
        if self.shift is not None and logits.requires_grad:
            self.shift.record(idx, self.n_experts)
        if self.aux_coef > 0 and logits.requires_grad:
            with torch.no_grad():
                counts_E = torch.bincount(idx.reshape(-1), minlength=self.n_experts)[: self.n_experts]
            coef = self.aux_coef
            shape = logits.shape

            def add_balance_grad(g: torch.Tensor) -> torch.Tensor:
                extra = switch_loss_grad(logits_NE, counts_E).reshape(shape)
                return g + coef * extra.to(g.dtype)

            logits.register_hook(add_balance_grad)


BIAS_UPDATES = ("sign", "smebu")


@dataclass(kw_only=True)
class BiasCorrector:
    """Pushes the selection bias of collapsing layers (see the module docstring), and, with
    `update`, runs the model's standing balancing update after every applied step."""

    biases: dict[int, Callable[[], torch.Tensor]]  # layer id -> the live bias tensor
    lam: float = 1e-3  # base step; the policy's boost multiplies it (x10 by default)
    kappa: float = 2.0
    bias_max: float = 1.0
    order: list[int] = field(default_factory=list)  # layer ids in router (loads_ME row) order
    # The standing update for implementations that never update their bias (every transformers
    # family): "sign" is DeepSeek-V3's b += u * sign(mean - n), mean-centred as in torchtitan, u =
    # update_rate (1e-3 in the paper); "smebu" is Trinity's soft-clamped momentum update
    # (smebu_step: lam 5e-4, kappa 2, beta 0.5). None: the model owns its balancing (torchtitan).
    # update_rate > 0 with update None means "sign" (the earlier keyword).
    update_rate: float = 0.0
    update: str | None = None
    smebu_lam: float = 5e-4
    smebu_kappa: float = 2.0
    smebu_beta: float = 0.5
    mode: str = MODE_BIAS
    momentum: dict[int, torch.Tensor] = field(default_factory=dict)  # SMEBU's m per layer

    def __post_init__(self) -> None:
        if self.update is None and self.update_rate > 0:
            self.update = "sign"
        if self.update is not None and self.update not in BIAS_UPDATES:
            raise ValueError(
                f"bias_update = {self.update!r}: must be one of {', '.join(BIAS_UPDATES)} or None"
            )
        if self.update == "sign" and self.update_rate <= 0:
            self.update_rate = 1e-3

    def correct(self, boosts: dict[int, float], loads_ME: torch.Tensor | None, applied: bool) -> None:
        if loads_ME is None or not applied:
            return
        if self.update is not None:
            with torch.no_grad():
                for m, layer in enumerate(self.order):
                    self._standing(layer, self.biases[layer](), loads_ME[m])
        for m, layer in enumerate(self.order):
            if layer in boosts and layer in self.biases:
                smebu_push(
                    self.biases[layer](),
                    loads_ME[m],
                    lam=self.lam * boosts[layer],
                    kappa=self.kappa,
                    bias_max=self.bias_max,
                )

    def _standing(self, layer: int, b: torch.Tensor, load_E: torch.Tensor) -> None:
        n_E = load_E.to(b.device, torch.float32)
        if self.update == "sign":
            d_E = self.update_rate * torch.sign(n_E.mean() - n_E)
            b.add_((d_E - d_E.mean()).to(b.dtype))
            return
        m_E = self.momentum.get(layer)
        if m_E is None or m_E.shape != n_E.shape or m_E.device != b.device:
            m_E = self.momentum[layer] = torch.zeros_like(n_E)
        b.add_(
            smebu_step(n_E, m_E, lam=self.smebu_lam, kappa=self.smebu_kappa, beta=self.smebu_beta).to(b.dtype)
        )

    def state_dict(self) -> dict[str, Any]:
        return {"momentum": {str(k): v.tolist() for k, v in self.momentum.items()}}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.momentum = {
            int(k): torch.tensor(v, dtype=torch.float32) for k, v in d.get("momentum", {}).items()
        }


def smebu_step(
    load_E: torch.Tensor, m_E: torch.Tensor, *, lam: float = 5e-4, kappa: float = 2.0, beta: float = 0.5
) -> torch.Tensor:
    """Trinity's SMEBU: v = (mean - n) / mean, d = lam * tanh(kappa * v), mean-centred,
    m = beta * m + (1 - beta) * d (m_E updated in place); returns the bias step m."""
    mean = load_E.mean().clamp_min(1e-12)
    d_E = lam * torch.tanh(kappa * (mean - load_E) / mean)
    m_E.mul_(beta).add_((1 - beta) * (d_E - d_E.mean()))
    return m_E


@dataclass(kw_only=True)
class AuxGradCorrector:
    """Arms the routing hooks of collapsing layers with a balancing gradient and pushes their
    LogitBias (see the module docstring); logit_rate = 0 leaves the correction gradient-only."""

    hooks: dict[int, TopKRoutingHook]
    base_coef: float = 1e-2  # switch-loss weight before the policy's boost
    # A standing per-layer balancing weight on every router (0: none). transformers' own aux loss
    # balances the load summed over all layers, so a single layer can collapse under it.
    balance_coef: float = 0.0
    # The load-shift gradient's norm relative to the router weight's own gradient (LoadShift)
    shift_ratio: float = 1.0
    # The selection bias on a corrected layer's logits (LogitBias): its step per applied step of
    # the correction and its bound, both in units of the layer's logit spread; 0: gradient only.
    logit_rate: float = 0.1
    logit_max: float = 4.0
    # A layer once corrected keeps its bias balancing after the correction ends (DeepSeek-V3's
    # bias is never frozen): the steps shrink to ~0 on a balanced load and grow again when the
    # layer drifts back (a clean tiny Mixtral's layer 3 relapsed 13 steps after a frozen bias).
    logit_hold: bool = True
    order: list[int] = field(default_factory=list)  # layer ids in router (loads_ME row) order
    logit_bias: dict[int, LogitBias] = field(default_factory=dict)  # the layers ever pushed
    mode: str = MODE_AUX

    def __post_init__(self) -> None:
        self.order = self.order or sorted(self.hooks)
        for hook in self.hooks.values():
            hook.aux_coef = self.balance_coef

    def correct(self, boosts: dict[int, float], loads_ME: torch.Tensor | None, applied: bool) -> None:
        for layer, hook in self.hooks.items():
            boost = self.base_coef * boosts[layer] if layer in boosts else 0.0
            hook.aux_coef = self.balance_coef + boost
            # ... and the load-shift gradient on the router's weight, which a saturated softmax
            # does not silence (load_shift_grad_W), unless the layer's router takes a LogitBias,
            # which does what that gradient emulates on the logits themselves
            if boost and self.logit_rate > 0 and layer not in self.logit_bias:
                lb = self._logit_bias_for(hook)
                if lb is not None:
                    self.logit_bias[layer] = lb
            biased = layer in self.logit_bias and self.logit_bias[layer].usable is not False
            w = getattr(hook.router, "weight", None)
            if boost and not biased and hook.shift is None and isinstance(w, nn.Parameter) and w.ndim == 2:
                hook.shift = LoadShift(hook.router, w, self.shift_ratio)
            elif (not boost or biased) and hook.shift is not None:
                hook.shift.remove()
                hook.shift = None
        # ... and the selection bias, pushed from this step's load (it acts from the next forward)
        if loads_ME is None or not applied:
            return
        for m, layer in enumerate(self.order):
            pushed = layer in boosts or self.logit_hold
            if pushed and layer in self.logit_bias and m < loads_ME.shape[0]:
                self.logit_bias[layer].push(loads_ME[m], rate=self.logit_rate, bound=self.logit_max)

    @staticmethod
    def _logit_bias_for(hook: TopKRoutingHook) -> LogitBias | None:
        """A LogitBias on the hook's router when its output is softmax (logits, weights, ids)."""
        r = getattr(hook, "reading", None)
        if r is None:  # a plain TopKRoutingHook: (logits, weights, indices)
            if hook.score_func != "softmax" or {hook.logits_index, hook.indices_index} != {0, 2}:
                return None
            return LogitBias(hook.router, n_experts=hook.n_experts)
        if (
            r.score_func != "softmax"
            or r.form != "indices"
            or r.weights_at is None
            or r.logits_at is None
            or r.ids_at is None
            or r.null_as is not None
        ):
            return None
        return LogitBias(
            hook.router,
            n_experts=r.n_experts,
            logits_at=r.logits_at,
            weights_at=r.weights_at,
            ids_at=r.ids_at,
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "logit_bias": {str(k): v.bias_E.tolist() for k, v in self.logit_bias.items()},
            "logit_push": {
                str(k): {"scale": float(v.scale), "step": v.step_E.tolist(), "sign": v.sign_E.tolist()}
                for k, v in self.logit_bias.items()
                if v.scale is not None and v.step_E is not None and v.sign_E is not None
            },
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        for k, v in d.get("logit_bias", {}).items():
            layer = int(k)
            if layer not in self.logit_bias and layer in self.hooks:
                lb = self._logit_bias_for(self.hooks[layer])
                if lb is not None:
                    self.logit_bias[layer] = lb
            if layer in self.logit_bias:
                lb = self.logit_bias[layer]
                lb.bias_E.copy_(torch.tensor(v, dtype=torch.float32))
                push = d.get("logit_push", {}).get(k)
                if push is not None:
                    dev = lb.bias_E.device
                    lb.scale = torch.tensor(float(push["scale"]), device=dev)
                    lb.step_E = torch.tensor(push["step"], dtype=torch.float32, device=dev)
                    lb.sign_E = torch.tensor(push["sign"], dtype=torch.float32, device=dev)

    def remove(self) -> None:
        for lb in self.logit_bias.values():
            lb.remove()
        self.logit_bias.clear()


@dataclass(kw_only=True)
class Attachment:
    """What an adapter found in a model: hand it to GuardedStep(attach=...)."""

    family: str
    layers: list[nn.Module]
    routers: list[tuple[int, RoutingSource]]
    corrector: Corrector | None = None
    n_experts: int = 0
    top_k: int = 0
    # Called after the guard's step whatever the decision (e.g. torchtitan zeroes its counters in
    # an optimizer pre-hook that a skipped step never runs).
    after_step: Callable[[bool], None] | None = None
    # Undoes whatever else the adapter changed on the model (e.g. transformers' watched attention)
    undo: list[Callable[[], None]] = field(default_factory=list)
    # What the adapter saw and deliberately does not observe or use, one line each (JetMoE's
    # attention experts, a bias that moves no selection)
    unobserved: list[str] = field(default_factory=list)

    @property
    def correction_mode(self) -> str:
        return self.corrector.mode if self.corrector is not None else MODE_NONE

    def remove(self) -> None:
        """Take every hook off the model."""
        for _, src in self.routers:
            if hasattr(src, "remove"):
                src.remove()
        if hasattr(self.corrector, "remove"):  # e.g. an AuxGradCorrector's selection biases
            self.corrector.remove()
        while self.undo:
            self.undo.pop()()
