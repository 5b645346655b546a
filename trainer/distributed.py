"""Multi-rank plumbing of the training loop (torchrun / torch.distributed; gloo on CPU, NCCL on GPU).

Parallel modes (`[train] parallel`):
    ddp   every rank holds the whole model; after backward the gradients are averaged with ONE
          coalesced all-reduce (`allreduce_grads`). This is data parallelism as DDP does it, but
          not torch's DistributedDataParallel wrapper, on purpose:
            * a faulty rank's gradient can be injected before the reduction (drills);
            * the time a rank waits for its peers is measured apart from its own work (DDP hides
              the wait inside backward), which straggler scores need;
            * no `find_unused_parameters` graph walk, no buffer broadcast, no `no_sync()` for
              gradient accumulation.
          Cost: no overlap of communication with backward. That matters at GPU scale (use fsdp
          there: FSDP2 overlaps its reduce-scatter with backward); on CPU/gloo it does not.
    fsdp  FSDP2: `fully_shard` on every block, then the root. Parameters, gradients and
          optimizer state are DTensor shards; the probe sums squared gradient norms across
          ranks, so the per-layer norms are the full ones. The collectives run inside
          forward/backward, so per-rank busy time (straggler score) cannot leave out the time a
          rank waited for peers there: scores under fsdp only see data-loading stragglers well.
    none  one process; WORLD_SIZE > 1 is refused.

The guard's side of several ranks (timed collectives, the decision agreement, straggler windows,
the heartbeat pump) is guard/runtime/ranks.py, shared with GuardedStep; re-exported here.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from guard.core.tomlconf import ConfigError
from guard.runtime.ranks import (
    ENV_DECISION_LOG,
    Agreed,
    Agreement,
    Comm,
    DecisionLog,
    Dist,
    HeartbeatPump,
    RankWindow,
    StepSync,
    decision_fingerprint,
)

__all__ = [
    "ENV_DECISION_LOG",
    "ENV_RESTART_COUNT",
    "Agreed",
    "Agreement",
    "Comm",
    "DecisionLog",
    "Dist",
    "HeartbeatPump",
    "RankWindow",
    "StepSync",
    "allreduce_grads",
    "decision_fingerprint",
    "local",
    "resolve_parallel",
    "restart_count",
    "setup_distributed",
    "shard_fsdp",
]

ENV_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"  # set by torchrun: 0 first, then 1, 2, ... per restart


def setup_distributed(device_pref: str) -> tuple[Dist, torch.device]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = device_pref == "cuda" or (device_pref == "auto" and torch.cuda.is_available())
    if device_pref == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device = 'cuda': no CUDA device is available (use 'auto' or 'cpu')")
    d = Dist()
    if world > 1:
        if not dist.is_initialized():
            backend = "nccl" if use_cuda else "gloo"
            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                _init_in_agent_store(backend, world)
            else:
                dist.init_process_group(backend=backend)
        d = Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))
    if use_cuda:
        torch.cuda.set_device(d.local_rank)
        return d, torch.device("cuda", d.local_rank)
    return d, torch.device("cpu")


def _init_in_agent_store(backend: str, world: int) -> None:
    """Under torchrun, join the agent's store with a key prefix per restart attempt.

    With torch 2.13 + gloo, `init_process_group("env://")` after a torchrun restart reads the
    peers' addresses of the previous attempt from the agent's store and fails ("Gloo
    connectFullMesh failed ... Connection refused"); a prefix per attempt keeps each attempt's
    rendezvous keys apart (checked by tests/trainer/test_distributed.py's restart test)."""
    import datetime

    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=False,
        timeout=datetime.timedelta(seconds=300),
    )
    prefixed = dist.PrefixStore(f"moeguard/attempt_{restart_count()}", store)
    dist.init_process_group(backend=backend, store=prefixed, rank=int(os.environ["RANK"]), world_size=world)


def resolve_parallel(mode: str, world: int) -> str:
    """The mode that actually runs: one process needs none of them."""
    if world == 1:
        return "none"
    if mode == "none":
        raise ConfigError(f"train.parallel = 'none' but WORLD_SIZE = {world}; use 'ddp' or 'fsdp'")
    return mode


def restart_count() -> int:
    """How many times torchrun restarted this job (0 outside torchrun)."""
    try:
        return int(os.environ.get(ENV_RESTART_COUNT, "0"))
    except ValueError:
        return 0


def shard_fsdp(model: nn.Module) -> None:
    """FSDP2: shard every transformer block, then the root (embeddings, final norm, head)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (FSDP2 shard), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def allreduce_grads(params: list[torch.nn.Parameter], world: int, comm: Comm | None = None) -> None:
    """Average gradients across ranks in one coalesced call (a parameter without a gradient this
    step gets zeros, so every rank flattens the same layout)."""
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    flat = torch._utils._flatten_dense_tensors(grads)
    if comm is not None:
        comm.all_reduce(flat)
    else:
        dist.all_reduce(flat)
    flat /= world
    for g, r in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
        g.copy_(r)
