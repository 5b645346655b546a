"""torchtitan's Trainer on a host without an accelerator (CPU, gloo): the launcher's fallback and
how the tests run torchtitan's own Trainer.

torchtitan 0.3.0 sets `device_type = "cuda"` on a host without an accelerator, and its Trainer
calls `torch.cuda.set_device` (AttributeError: torch._C has no _cuda_setDevice). `use_cpu` points
the device globals of the modules that imported them at `torch.cpu` (plus the memory-stat calls
its metrics make, which torch.cpu lacks), no-ops `set_pg_timeouts` (it calls
torch.distributed.set_timeout, which torch 2.13 lacks), and keeps FSDP2 off PREMUL_SUM, which
gloo lacks. Training itself (train_step, the
optimizers container, its hooks, FSDP on gloo) stays torchtitan's. `device_type = "cpu"` also makes
torchtitan pick gloo as the process-group backend.
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Callable
from typing import Any

import torch

# torchtitan modules that bind `device_type` / `device_module` at import time
MODULES = (
    "tools.utils",
    "distributed.utils",
    "distributed.parallel_dims",
    "components.metrics",
    "models.common.token_dispatcher",
    "tools.profiler",
)


def needs_cpu() -> bool:
    """No CUDA device: torchtitan's device globals must be pointed at the CPU."""
    return not torch.cuda.is_available()


def cpu_module() -> Any:
    """torch.cpu with the calls torchtitan makes of a device module that it lacks."""
    cpu = types.SimpleNamespace(
        **{k: getattr(torch.cpu, k) for k in dir(torch.cpu) if not k.startswith("__")}
    )
    cpu.__dict__.update(
        get_device_name=lambda *a: "cpu",
        current_device=lambda: 0,
        device_count=lambda: 1,
        get_device_properties=lambda *a: types.SimpleNamespace(total_memory=1 << 30),
        reset_peak_memory_stats=lambda *a: None,
        empty_cache=lambda: None,
        memory_stats=lambda *a: {},
        set_device=lambda *a: None,
    )
    return cpu


def use_cpu(setattr_: Callable[[Any, str, Any], None] = setattr) -> None:
    """Point torchtitan at the CPU. `setattr_`: how to set (pytest's monkeypatch.setattr undoes it)."""
    cpu = cpu_module()
    for name in MODULES:
        mod = importlib.import_module(f"torchtitan.{name}")
        for attr, value in (("device_type", "cpu"), ("device_module", cpu)):
            if hasattr(mod, attr):
                setattr_(mod, attr, value)
    setattr_(importlib.import_module("torchtitan.distributed.utils"), "set_pg_timeouts", lambda **k: None)
    fsdp = importlib.import_module("torchtitan.distributed.fsdp")
    setattr_(fsdp, "disable_fsdp_gradient_division", _gloo_safe(fsdp.disable_fsdp_gradient_division))


def _gloo_safe(disable_division: Callable[[Any], None]) -> Callable[[Any], None]:
    """torchtitan turns FSDP's gradient division off (factor 1.0: it divides by the global token
    count itself); FSDP2 then reduce-scatters with PREMUL_SUM(1.0), which gloo lacks. Forcing sum
    reductions keeps the same arithmetic (a factor of 1) on gloo."""
    from torch.distributed.fsdp import FSDPModule

    def disable(model: Any) -> None:
        disable_division(model)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)

    return disable
