"""guard/runtime/apply.py: the one place a Decision changes the training state."""

from __future__ import annotations

import torch

from guard.core import schema
from guard.core.config import GuardConfig
from guard.core.policy import Decision
from guard.runtime.apply import DecisionApplier
from guard.runtime.guard import Guard
from trainer.correction import ModelCorrector
from trainer.model import ModelConfig, MoETransformer


def test_an_aux_boost_decided_with_a_rollback_survives_the_rollback() -> None:
    """The aux-loss weight is a model buffer, so a snapshot holds it: a correction applied before
    the restore would be overwritten at once while the events say it was applied."""
    torch.manual_seed(0)
    model = MoETransformer(
        ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_experts=4, top_k=2)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = Guard(GuardConfig(), model, opt)
    routers = [(i, layer.router) for i, layer in model.moe_layers()]
    corrector = ModelCorrector(model, routers, bias=False, bias_max=1.0, aux_coef=0.01)
    applier = DecisionApplier(opt, guard, corrector=corrector)
    guard.ring.take(0)  # type: ignore[union-attr]
    layer = routers[0][0]
    d = Decision(step=5, action=schema.ACT_ROLLBACK, aux_boost={layer: 10.0}, rollback_before=5)
    applier.apply(d, grad_norm=1.0)
    coef = dict(model.moe_layers())[layer].aux_loss_coef
    assert float(coef) == torch.tensor(0.1).item()  # 0.01 x 10, not the snapshot's 0.01
