"""torchtitan MoE decoders (DeepSeek-V3, Qwen3-MoE, ...): the guard reads torchtitan's own counters.

Plain loop (a torchtitan model built from its configs; one rank or FSDP/DP, no pipeline):

    model = model_config.build(); model.init_weights(buffer_device=None)  # after parallelize_fn
    optimizer = torch.optim.AdamW(model.parameters(), lr=8e-4)
    register_moe_load_balancing_hook(optimizer, [model], parallel_dims)   # torchtitan's bias update
    guarded = GuardedStep(model, optimizer, attach=attach(model), run_dir="runs/x")
    ... loss.backward(); guarded.step(loss, tokens=n)

Loads are each MoE's `tokens_per_expert_E`, the buffer its forward fills with what the router
chose and torchtitan's aux-loss-free balancing reads (never a re-derived top-k); the entropy comes
from a forward hook on `moe.router` (its `scores_BLE`).

Who zeroes `tokens_per_expert_E`: torchtitan's `_update_expert_bias`, an optimizer step PRE-hook,
moves `expert_bias_E` and zeroes the counters, but only inside `optimizer.step()`: a step the guard
skips never runs it, and a loop without the hook (no load_balance_coeff, or not registered) never
zeroes them. So `after_step` zeroes them after EVERY step: a no-op after an applied step with the
hook, required in the two other cases (else a skipped step's counts leak into the next).

Correction: a bounded push on `expert_bias_E` (on top of torchtitan's own update) when
load_balance_coeff is set; else none, and collapses are recorded, never claimed as corrected.

`GuardedTrainer` (trainer.py): torchtitan's own Trainer with the guard deciding its optimizer
step, streaming to the collector, its state in torchtitan's checkpoint. One command runs it:

    torchrun --nproc_per_node 8 -m guard.integrations.torchtitan --module deepseek_v3 \
        --config deepseek_v3_debugmodel [torchtitan flags] [--guard guard.toml] \
        [--collector URL] [--run-dir DIR]

(__main__.py; `--help` explains). torchtitan 0.3.0's Trainer does not run on a CPU-only host: with
no accelerator it sets `device_type = "cuda"` and calls `torch.cuda.set_device`; on such a host the
launcher points its device globals at the CPU first (cpu.py), which is how the tests run it on
gloo. It has not run on a GPU here.
"""

from __future__ import annotations

from typing import Any

# The adapter's names load on first use (PEP 562), like GuardedTrainer: `python -m
# guard.integrations.torchtitan` imports this package before its __main__ runs, and the launcher
# decides how torch and torchtitan are imported (__main__.py: without the cyclic GC).
_ADAPTER = ("MoECounters", "OptimizersView", "attach", "blocks_of", "force_collapse")
__all__ = [*_ADAPTER, "GuardedTrainer"]


def __getattr__(name: str) -> Any:
    if name in _ADAPTER:
        from guard.integrations.torchtitan import adapter

        globals()[name] = value = getattr(adapter, name)
        return value
    # Built on first use: attach() and the plain-loop path never import torchtitan.trainer.
    if name == "GuardedTrainer":
        from guard.integrations.torchtitan.trainer import guarded_trainer

        globals()[name] = cls = guarded_trainer()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
