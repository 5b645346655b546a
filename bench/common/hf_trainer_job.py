"""A real transformers `Trainer` run on a tiny MoE (guard/integrations/tiny.py), guarded by
MoEGuardCallback or not: what the callback's tests, the canary's `--script` tests and the Trainer
overhead bench all run. One rank, or several under torchrun (DDP on gloo).

    python bench/common/hf_trainer_job.py --family mixtral --steps 60 --out /tmp/job
    python bench/common/hf_trainer_job.py --inject gradspike@20:1000 --inject nan@30 --grad-accum 2 --out /tmp/job
    python bench/common/hf_trainer_job.py --steps 40 --save-steps 20 --out /tmp/job   # then, resumed:
    python bench/common/hf_trainer_job.py --steps 40 --save-steps 20 --out /tmp/job --resume /tmp/job/checkpoint-20
    torchrun --nproc_per_node 2 bench/common/hf_trainer_job.py --family deepseek_v3 --out /tmp/job
    moeguard canary --ab set: set: --script "python bench/common/hf_trainer_job.py --steps 60 --out {run_dir}/job"

Faults (`--inject`, at optimizer step S, applied on every rank to the reduced gradients just before
the guard decides): `gradspike@S:X` scales every gradient by X, `nan@S` puts a NaN in one gradient,
`collapse@S:LAYER` pushes that layer's router towards expert 0 at its next forward
(guard.integrations.transformers.force_collapse). For spike and NaN the job keeps a bitwise copy of
the weights, optimizer state and LR schedule before step S and says whether step S left them all
unchanged (`checks` in the rank's JSON). Each rank writes OUT/rank<R>.json: the Trainer's log
history, the checks, the guard's decisions and a hash of the final weights.

Writes docs/BENCHMARKS.md: no section of its own; the Trainer job of Overhead › Guard overhead on
the transformers Trainer (mixtral), 1,024 tokens a step and of Canaries › A/B canary on your own
training (`moeguard canary --ab --script`, issue #27).
"""

from __future__ import annotations

import sys
from pathlib import Path as _P

sys.path.insert(0, str(_P(__file__).resolve().parents[2]))  # `python bench/<group>/x.py` from a checkout

import gc

# A process of its own (~40 in the suite: drills, canary A/B tests, the GPU dry run; both sides of
# every comparison run this job): no cyclic GC until the Trainer is built, then its start-up heap
# frozen (main(start_up_frozen=True); guard/runtime/start_up_gc.py).
if __name__ == "__main__":
    gc.disable()

import argparse
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from guard.integrations.tiny import FAMILIES, build
from guard.runtime.start_up_gc import freeze_start_up


class ByteWindows(torch.utils.data.Dataset):
    """`n` fixed (seq,) windows of stdlib bytes, reproducible per seed; labels = inputs."""

    def __init__(self, corpus: np.ndarray, *, n: int, seq: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.starts = rng.integers(0, corpus.size - seq - 1, size=n)
        self.corpus, self.seq = corpus, seq

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s = int(self.starts[i])
        x = torch.from_numpy(self.corpus[s : s + self.seq].astype(np.int64))
        return {"input_ids": x, "labels": x.clone()}


def _clone_state(model: torch.nn.Module, opt: Any, sched: Any) -> dict[str, Any]:
    inner = getattr(opt, "optimizer", opt)
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "opt": [
            {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for s in inner.state.values()
        ],
        "lr": [g["lr"] for g in inner.param_groups],
        "sched": sched.last_epoch if sched is not None else None,
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> dict[str, bool]:
    def eq(x: Any, y: Any) -> bool:
        return torch.equal(x, y) if torch.is_tensor(x) else x == y

    return {
        "weights": a["model"].keys() == b["model"].keys()
        and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]),
        "optimizer": len(a["opt"]) == len(b["opt"])
        and all(
            sa.keys() == sb.keys() and all(eq(sa[k], sb[k]) for k in sa)
            for sa, sb in zip(a["opt"], b["opt"], strict=True)
        ),
        "lr": a["lr"] == b["lr"],
        "scheduler": a["sched"] == b["sched"],
    }


class Faults(TrainerCallback):
    """Fault injection at optimizer steps (list it BEFORE MoEGuardCallback: it runs first)."""

    def __init__(self, specs: list[str]) -> None:
        from guard.core.inject import parse_injections

        self.faults: dict[int, tuple[str, float]] = {}
        for inj in parse_injections(specs):  # guard/core/inject.py's spec, three of its kinds
            if inj.kind not in ("gradspike", "nan", "collapse"):
                raise SystemExit(f"--inject {str(inj)!r}: expected gradspike@S:X, nan@S or collapse@S:LAYER")
            self.faults[inj.step] = (inj.kind, inj.arg)
        self.before: tuple[int, dict[str, Any]] | None = None
        self.checks: dict[int, dict[str, bool]] = {}

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        kind, arg = self.faults.get(state.global_step, ("", 0.0))
        if kind == "collapse":
            from guard.integrations.transformers import force_collapse

            force_collapse(kw["model"], int(arg))

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        kind, arg = self.faults.get(state.global_step, ("", 0.0))
        if kind not in ("gradspike", "nan"):
            return
        model = kw["model"]
        self.before = (state.global_step, _clone_state(model, kw["optimizer"], kw["lr_scheduler"]))
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if kind == "gradspike":
            torch._foreach_mul_(grads, arg)
        else:
            grads[0].view(-1)[0] = float("nan")

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.before is not None:
            step, snap = self.before
            after = _clone_state(kw["model"], kw["optimizer"], kw["lr_scheduler"])
            self.checks[step] = _same(snap, after)
            self.before = None


class Recorder(TrainerCallback):
    """After each optimizer step: the guard's action, the LR in the optimizer and (with `weights`)
    a hash of the weights."""

    def __init__(self, guard: Any, *, weights: bool = False) -> None:
        self.guard, self.weights = guard, weights
        self.actions: list[str] = []
        self.lrs: list[float] = []
        self.hashes: list[str] = []
        self.lr_bound: float | None = None  # the guard's LR bound (None: none armed)

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.guard is not None and self.guard.decision is not None:
            self.actions.append(self.guard.decision.action)
            bound = self.guard.guarded.guard.engine.lr_bound
            self.lr_bound = bound.max_lr if bound is not None else None
        opt = kw["optimizer"]
        self.lrs.append(getattr(opt, "optimizer", opt).param_groups[0]["lr"])
        if self.weights:
            self.hashes.append(weights_hash(kw["model"]))


def training_args(out: Path, a: argparse.Namespace) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(out),
        max_steps=a.steps,
        per_device_train_batch_size=a.batch,
        gradient_accumulation_steps=a.grad_accum,
        learning_rate=a.lr,
        lr_scheduler_type="cosine",
        warmup_steps=a.warmup,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="steps" if a.save_steps else "no",
        save_steps=a.save_steps or 500,
        report_to=a.report_to,
        seed=a.seed,
        data_seed=a.seed,
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
    )


def make_trainer(
    a: argparse.Namespace, out: Path, corpus: np.ndarray
) -> tuple[Trainer, Any, Faults, Recorder]:
    # --balance-coef > 0: balanced as the guard drills train from scratch (bench/drills/real_models.py):
    # a per-layer balancing weight instead of transformers' pooled aux loss, DeepSeek-V3's own bias
    # update (u = 1e-2), so a forced collapse can be corrected and recover.
    model = build(a.family, seed=a.seed, aux_loss_coef=0.0 if a.balance_coef > 0 else 0.01)
    if a.resume:
        _load_moe_weights(model, a.resume, out)
    args = training_args(out, a)
    n = a.steps * a.batch * a.grad_accum * args.world_size
    ds = ByteWindows(corpus, n=n, seq=a.seq, seed=a.seed)
    guard = None
    faults = Faults(a.inject)
    callbacks: list[TrainerCallback] = [faults]
    if not a.no_guard:
        from guard.integrations.hf_trainer import MoEGuardCallback

        att = None
        if a.balance_coef > 0:
            from guard.integrations.transformers import attach

            rate = 1e-2 if a.family == "deepseek_v3" else 0.0
            att = attach(model, balance_coef=a.balance_coef, bias_update_rate=rate)
        guard = MoEGuardCallback(run_dir=a.run_dir, config=a.guard, attach=att)
        callbacks.append(guard)
    rec = Recorder(guard, weights=a.record_weights)
    callbacks.append(rec)
    return Trainer(model=model, args=args, train_dataset=ds, callbacks=callbacks), guard, faults, rec


def _load_moe_weights(model: torch.nn.Module, resume: str, out: Path) -> None:
    """The checkpoint's weights, loaded through transformers' key conversion. transformers 5.23's
    Trainer resume loads `model.safetensors` with a plain load_state_dict, but save_pretrained wrote
    the experts and routers under the hub's per-expert names: they come back as "unexpected keys"
    and stay at their init (huggingface/transformers#48805, fix in PR #48822). from_pretrained
    converts them; the Trainer's own load then rewrites the other weights with the same values."""
    from transformers import AutoModelForCausalLM
    from transformers.trainer_utils import get_last_checkpoint

    folder = get_last_checkpoint(str(out)) if resume == "last" else resume
    loaded = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")
    model.load_state_dict(loaded.state_dict())


def weights_hash(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None, *, start_up_frozen: bool = False) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="mixtral", choices=FAMILIES)
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps")
    ap.add_argument("--batch", type=int, default=4, help="sequences per micro-batch per rank")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=5, help="LR warm-up steps (cosine schedule after)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True, help="Trainer output_dir; rank<R>.json go here")
    ap.add_argument(
        "--run-dir", type=Path, default=None, help="the guard's run store (default: the callback's)"
    )
    ap.add_argument("--guard", type=Path, default=None, help="guard config TOML")
    ap.add_argument("--no-guard", action="store_true", help="the plain Trainer, no callback")
    ap.add_argument("--inject", action="append", default=[], metavar="KIND@STEP[:ARG]")
    ap.add_argument("--report-to", default="none", help="TrainingArguments.report_to (default none)")
    ap.add_argument(
        "--balance-coef",
        type=float,
        default=0.0,
        help="> 0: attach(balance_coef=X) and no pooled aux loss (see make_trainer); 0: attach's defaults",
    )
    ap.add_argument("--record-weights", action="store_true", help="a weights hash after every step")
    ap.add_argument("--save-steps", type=int, default=0, help="a Trainer checkpoint every N steps (0: none)")
    ap.add_argument(
        "--resume", default=None, help="train(resume_from_checkpoint=...): a checkpoint folder, or 'last'"
    )
    a = ap.parse_args(argv)
    from trainer.data import stdlib_corpus

    torch.set_num_threads(a.threads)
    corpus = stdlib_corpus(2_000_000)
    trainer, guard, faults, rec = make_trainer(a, a.out, corpus)
    if start_up_frozen:
        freeze_start_up()
    trainer.train(resume_from_checkpoint=True if a.resume == "last" else a.resume)
    rank = trainer.args.process_index
    res = {
        "rank": rank,
        "world_size": trainer.args.world_size,
        "log_history": trainer.state.log_history,
        "checks": {str(k): v for k, v in faults.checks.items()},
        "actions": rec.actions,
        "lrs": rec.lrs,
        "hashes": rec.hashes,
        "lr_bound": rec.lr_bound,
        "global_step": trainer.state.global_step,
        "weights": weights_hash(trainer.model),
        "max_grad_norm_after": trainer.args.max_grad_norm,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"rank{rank}.json").write_text(json.dumps(res, indent=1, default=str))
    return res


if __name__ == "__main__":
    main(start_up_frozen=True)
