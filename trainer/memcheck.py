"""Will the model fit? Checked from the config before anything is allocated.

A model past the machine's memory used to end in an allocator traceback minutes into start-up
(issue #32). Training in fp32 with AdamW holds, per parameter, the weight, its gradient and two
moment buffers: 16 bytes. That floor (activations, the guard's snapshots and the allocator's
slack come on top) is compared with what the device has free now; past it, one line names the
model's size, what it needs and what there is.
"""

from __future__ import annotations

import os
from typing import Any

from guard.core.tomlconf import ConfigError
from trainer.model_config import ModelConfig

BYTES_PER_PARAM = 16  # fp32 weight + gradient + AdamW's two moments


def total_params(cfg: ModelConfig) -> int:
    """Every parameter of the model (all experts, embeddings and head), norms left out."""
    D = cfg.d_model
    n_moe = cfg.n_layers - cfg.dense_layers
    attn = 4 * D * D
    moe = D * cfg.n_experts + 3 * D * cfg.d_expert * (cfg.n_experts + cfg.n_shared_experts)
    dense = 3 * D * cfg.d_dense
    embed = cfg.vocab_size * D * (1 if cfg.tie_embeddings else 2)
    return cfg.n_layers * attn + n_moe * moe + cfg.dense_layers * dense + embed


def available_bytes(device: str) -> tuple[int | None, str]:
    """(bytes free for this process, where that figure comes from); None when unknown."""
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            free, _ = torch.cuda.mem_get_info()
            return int(free), "free GPU memory"
        return None, "no GPU"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    per_rank = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
                    return int(line.split()[1]) * 1024 // per_rank, f"MemAvailable / {per_rank} local ranks"
    except OSError:
        pass
    return None, "unknown"


def check_model_fits(cfg: Any, device: str) -> None:
    """ConfigError (one line) when the model's parameters and optimizer state alone exceed the
    memory free on `device` ("cpu" or "cuda[:N]")."""
    n = total_params(cfg.model)
    need = n * BYTES_PER_PARAM
    have, where = available_bytes(device)
    if have is not None and need > have:
        raise ConfigError(
            f"model: {n:,} parameters need at least {need / 2**30:.1f} GiB for weights, gradients and "
            f"AdamW state ({BYTES_PER_PARAM} bytes each), but {device} has {have / 2**30:.1f} GiB "
            f"({where}); shrink model.d_model, n_layers, n_experts or d_expert"
        )
