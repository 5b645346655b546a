"""The model side of a step, as OLMo-core's TrainModule: the model built for this device, dtype
and parallel mode, its optimizer, forward/backward over micro-batches, the gradient reduction
across ranks, and the plain loop's update. What happens around it (probe, guard, decision,
callbacks, records) is the trainer's (trainer/loop.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from guard.core.tomlconf import ConfigError
from guard.runtime.probe import Probe
from trainer.config import TrainConfig
from trainer.distributed import Comm, Dist, allreduce_grads, resolve_parallel, shard_fsdp
from trainer.kernels import unavailable_backend
from trainer.model import MoETransformer


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    # Decay matrices only (norm gains and embeddings' rows are left alone, as in nanoGPT).
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2 and "embed" not in n]
    rest = [
        p for n, p in model.named_parameters() if p.requires_grad and not (p.ndim >= 2 and "embed" not in n)
    ]
    o = cfg.optim
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        foreach=True,
    )


def build_model(cfg: TrainConfig, device: torch.device, dtype: torch.dtype) -> MoETransformer:
    """The model on `device`; a kernel choice this device, dtype or torch build cannot run is a
    ConfigError that lists what does run here."""
    try:
        return MoETransformer(cfg.model, device=device, compute_dtype=dtype)
    except ValueError as e:
        if not str(e).startswith(("attention=", "experts_kernel=")):
            raise
        m = cfg.model
        raise ConfigError(
            unavailable_backend(
                e, device, dtype, n_heads=m.n_heads, head_dim=m.head_dim, seq_len=m.max_seq_len
            )
        ) from None


def compute_dtype(want: str, device: torch.device) -> torch.dtype:
    if want == "bf16" or (want == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


def set_deterministic(compile: bool) -> None:
    if compile:
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        # The same switch without importing torch._inductor (4 s per process) to set its flag.
        torch._C._set_deterministic_algorithms(True, warn_only=True)


class TrainModule:
    def __init__(self, cfg: TrainConfig, dist: Dist, device: torch.device, comm: Comm) -> None:
        """Build the model (seed the global RNG first: initialisation follows it), shard it for
        fsdp, compile it when asked, and its optimizer."""
        self.cfg, self.world, self.device, self.comm = cfg, dist.world, device, comm
        self.parallel = resolve_parallel(cfg.train.parallel, dist.world)
        self.dtype = compute_dtype(cfg.train.dtype, device)
        self.model = build_model(cfg, device, self.dtype)
        if self.parallel == "fsdp":
            shard_fsdp(self.model)  # before anything holds parameter references
        self.fwd = torch.compile(self.model) if cfg.train.compile else self.model
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = build_optimizer(self.model, cfg)

    def forward_backward(self, batches: list[torch.Tensor]) -> torch.Tensor:
        """Gradients of the mean loss (plus the balancing loss) over the micro-batches; returns
        the summed language-model loss, on the device (no host sync)."""
        self.model.train()
        loss_sum = torch.zeros((), device=self.device)
        n = len(batches)
        for b in batches:
            x, y = b[:, :-1], b[:, 1:]
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.dtype == torch.bfloat16):
                logits, aux = self.fwd(x)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
            ((loss + aux) / n).backward()
            loss_sum += loss.detach()
        return loss_sum

    def reduce_grads(self) -> None:
        if self.parallel == "ddp":
            allreduce_grads(self.params, self.world, self.comm)
        # fsdp: reduce-scattered inside backward; none: nothing to do

    def plain_update(self, lr: float, probe: Probe) -> None:
        """Telemetry off: the update any PyTorch loop makes (clip, step, the routers' own bias
        balancing from the step's loads, zero the gradients)."""
        if self.cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.optim.grad_clip, foreach=True)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        if probe.routers and self.cfg.model.bias_mode != "off":
            loads, _, _ = probe.reduced_router_stats()
            for m, (_, router) in enumerate(probe.routers):
                router.update_bias(loads[m])
        self.opt.zero_grad(set_to_none=True)
