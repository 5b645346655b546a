"""Part `acting`: the guard acting on the device, in the transformers Trainer (the same drill as
tests/guard/test_hf_trainer.py, on CUDA when there is one).

One guarded run of guard/integrations/tiny.py's Mixtral (fp32) with bench/common/hf_trainer_job.py's
fault injection (its `Faults` callback: at optimizer step S, into the reduced gradients just
before the guard decides, with a bitwise copy of weights, AdamW state, LR and schedule taken
before): a NaN at NAN_AT must be skipped with all of them unchanged; a x50 spike at SPIKE_AT must
be flagged (a grad-norm verdict at that step) and kept as the unguarded run keeps it (the default
clip_spikes: clipped to the detector's threshold, then to max_grad_norm 1.0, the tighter, so the
step is applied: the weights change);
`force_collapse` at COLLAPSE_AT sends every token of layer LAYER to expert 0, which the guard must
correct (a bias_correct action after it, a recovered event, the layer's MaxVio back under 1).

Writes docs/BENCHMARKS.md › GPU, through `bench/gpu/report.py`: no section of its own.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.gpu.common import PartLog

NAN_AT, SPIKE_AT, SPIKE_X, COLLAPSE_AT, LAYER, STEPS = 30, 40, 50.0, 80, 2, 200
GUARD_TOML = "[collapse]\nwarmup = 60\n"  # tiny models settle fast (tests/guard/test_hf_trainer.py)


def _faults(faults: Any) -> Any:
    """bench/common/hf_trainer_job.Faults for our three faults; its gradient spike is `gradspike` (the
    spec of guard/core/inject.py), `spike` before that."""
    rest = [f"nan@{NAN_AT}", f"collapse@{COLLAPSE_AT}:{LAYER}"]
    try:
        return faults([f"gradspike@{SPIKE_AT}:{SPIKE_X:g}", *rest])
    except (SystemExit, ValueError):
        return faults([f"spike@{SPIKE_AT}:{SPIKE_X:g}", *rest])


def run(log: PartLog, *, dry: bool, deadline: float) -> None:
    import polars as pl
    from transformers import Trainer, TrainingArguments

    from bench.common.hf_trainer_job import ByteWindows, Faults, Recorder
    from guard.core import schema
    from guard.integrations.hf_trainer import MoEGuardCallback
    from guard.integrations.tiny import build
    from guard.integrations.transformers import attach
    from guard.store.reader import read_table
    from trainer.data import stdlib_corpus

    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(1)
    log.put(
        "setup",
        {
            "device": "cuda" if cuda else "cpu",
            "faults": f"nan@{NAN_AT} spike@{SPIKE_AT}:{SPIKE_X:g} collapse@{COLLAPSE_AT}:{LAYER}",
            "steps": STEPS,
        },
    )
    with tempfile.TemporaryDirectory(prefix="moeguard-gpu-acting-") as d:
        tmp = Path(d)
        cfg = tmp / "guard.toml"
        cfg.write_text(GUARD_TOML)
        model = build("mixtral", seed=0, aux_loss_coef=0.0)
        run_dir = tmp / "run"
        faults = _faults(Faults)
        guard = MoEGuardCallback(
            run_dir=run_dir, config=cfg, attach=attach(model, balance_coef=0.01, bias_update_rate=0.0)
        )
        rec = Recorder(guard)
        args = TrainingArguments(
            output_dir=str(tmp / "out"),
            max_steps=STEPS,
            per_device_train_batch_size=4,
            learning_rate=3e-3,
            lr_scheduler_type="cosine",
            warmup_steps=5,
            max_grad_norm=1.0,
            logging_steps=10,
            save_strategy="no",
            report_to="none",
            seed=0,
            data_seed=0,
            use_cpu=not cuda,
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        ds = ByteWindows(stdlib_corpus(2_000_000), n=STEPS * 4, seq=64, seed=0)
        Trainer(model=model, args=args, train_dataset=ds, callbacks=[faults, guard, rec]).train()
        log.put("model_device", str(next(model.parameters()).device))
        events = read_table(run_dir, "events")
        for name, at, want in (
            ("nan", NAN_AT, schema.ACT_SKIP),
            (f"spike x{SPIKE_X:g}", SPIKE_AT, schema.ACT_APPLY),
        ):
            checks: dict[str, Any] = faults.checks.get(at, {})
            action = rec.actions[at] if at < len(rec.actions) else None
            flagged = sorted(
                set(events.filter((pl.col("kind") == schema.EV_VERDICT) & (pl.col("step") == at))["detector"])
            )
            if want == schema.ACT_SKIP:  # nothing moved
                ok = action == want and bool(checks) and all(checks.values())
            else:  # flagged, and the update went in
                ok = action == want and bool(flagged) and bool(checks) and not checks.get("weights", True)
            log.put(name, {"step": at, "action": action, "flagged": flagged, "unchanged": checks, "ok": ok})
        layers = read_table(run_dir, "layers").filter(pl.col("layer") == LAYER).sort("step")
        maxvio = layers["maxvio"]
        # what followed the forced collapse (a natural correction before it is not the drill's)
        after_fault = pl.col("step") > COLLAPSE_AT
        acts = events.filter(
            (pl.col("kind") == schema.EV_ACTION) & (pl.col("action") == schema.ACT_BIAS_CORRECT) & after_fault
        )
        rec_ev = events.filter((pl.col("kind") == schema.EV_RECOVERED) & after_fault)
        first_fix = int(acts["step"].min()) if acts.height else None
        back = int(rec_ev["step"].min()) if rec_ev.height else None
        after = float(maxvio.slice(back, 20).median()) if back is not None else None
        log.put(
            "collapse",
            {
                "layer": LAYER,
                "at": COLLAPSE_AT,
                "maxvio_at": float(maxvio[COLLAPSE_AT]),
                "bias_correct_from": first_fix,
                "recovered_at": back,
                "maxvio_after_recovery": after,
                "bias_corrects_before": int(
                    events.filter(
                        (pl.col("kind") == schema.EV_ACTION)
                        & (pl.col("action") == schema.ACT_BIAS_CORRECT)
                        & ~after_fault
                    ).height
                ),
                "ok": first_fix is not None and after is not None and after < 1.0,
            },
        )
        log.put("actions", {a: rec.actions.count(a) for a in sorted(set(rec.actions))})
