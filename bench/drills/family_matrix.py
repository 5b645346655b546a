"""The integration matrix over every sparse-MoE causal-LM family of transformers 5.23 (issue #28).

Per family (tiny random-init models from guard/integrations/tiny.py, stdlib bytes, AdamW lr 3e-3,
grad clip 1.0, GuardConfig's defaults; selection-bias families run DeepSeek-V3's sign update,
u = 1e-2, every other family a per-layer balancing weight of 1e-2, as bench/drills/real_models.py does):

  attach   ok (the form its routers were read in) or refused (the message)
  loads    every step and layer of the faulty run: the stored loads equal the ids each experts
           module was handed (or, for Llama4 and JetMoE, the top-k of the router's own logits)
  faults   x50 gradient spikes at steps 30, 150, 400 and NaN gradients at 31, 151, 401 of one run:
           each skipped with every weight, buffer and AdamW state bitwise unchanged (or, where a
           natural skip within 50 steps makes it the third, rolled back to an earlier snapshot)
  other    actions at any other step of that run (its clean steps: the no-action check)
  collapse layer L's router pushed to expert 0 at step 60 (collapse warm-up 40): steps until
           its MaxVio is back under the detector's threshold for 5 steps, with the guard's
           correction and without (the control: the same run, no corrector); where per-step
           MaxVio never gets there (a family that sends each batch to a few experts), the same
           on the loads pooled over the detector's 10-step window, the rule its verdicts use

    python -m bench.drills.family_matrix --families afmoe,llama4_text --out OUT.jsonl
    python -m bench.drills.family_matrix --table OUT.jsonl [OUT2.jsonl ...]      # the Markdown table
    python -m bench.drills.family_matrix --bias-updates afmoe --steps 1000 --out OUT.jsonl

--quick runs attach and the load check only (12 steps), for every family in minutes.
--bias-updates FAMILY: the same family three times over --steps, with SMEBU, the sign update and
no bias update: MaxVio per layer (mean over the last 100 steps) and the final loss.

Writes docs/BENCHMARKS.md › transformers families and early-run spikes › Every transformers MoE
family (issue #28).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch

from bench.drills.real_models import byte_batches
from guard.api import GuardedStep
from guard.core.config import CollapseConfig, GuardConfig
from guard.core.routing_stats import maxvio_and_entropy
from guard.integrations import hf_routing as rt
from guard.integrations.base import BiasCorrector
from guard.integrations.tiny import ALL_FAMILIES, build
from guard.integrations.transformers import attach, decoder_layers, force_collapse, router_linear
from guard.store.reader import read_table

SPIKES, NANS = (30, 150, 400), (31, 151, 401)


def _attach(model: torch.nn.Module, bias_update: str | None) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        att = attach(model, balance_coef=1e-2)
    if isinstance(att.corrector, BiasCorrector):
        att.corrector.update = bias_update
        att.corrector.update_rate = 1e-2 if bias_update == "sign" else 0.0
    return att


def independent_loads(model: torch.nn.Module, att: Any) -> tuple[list[dict[int, torch.Tensor]], list]:
    """Per forward, per layer: the expert ids the model used, read without the guard's hook."""
    seen: list[dict[int, torch.Tensor]] = [{}]
    handles = []
    sites = {s.layer: s for s in rt.find_sites(decoder_layers(model)) if not s.attention}
    for layer, hook in att.routers:
        s, r = sites[layer], hook.reading
        if r.form in (rt.FORM_MASK, rt.FORM_COUNTS):

            def fwd(m: Any, a: Any, out: Any, layer: int = layer, r: Any = r) -> None:
                ids = out[r.logits_at].detach().reshape(-1, r.n_experts).topk(r.top_k, -1).indices
                seen[-1][layer] = torch.bincount(ids.reshape(-1), minlength=r.n_experts)

            handles.append(s.router.register_forward_hook(fwd))
        elif r.null_as is not None:  # zaya's skip expert reaches the experts as (0, weight 0):
            # ZayaRouter's own rule instead, top-k of softmax(logits) + balancing_biases

            def fwd(m: Any, a: Any, out: Any, layer: int = layer, r: Any = r) -> None:
                probs = out[r.logits_at].detach().reshape(-1, r.n_experts).softmax(-1).float()
                ids = (probs + m.balancing_biases).topk(r.top_k, -1).indices
                seen[-1][layer] = torch.bincount(ids.reshape(-1), minlength=r.n_experts)

            handles.append(s.router.register_forward_hook(fwd))
        else:

            def pre(m: Any, a: Any, layer: int = layer, e: int = r.n_experts) -> None:
                ids = next(t for t in a if isinstance(t, torch.Tensor) and not t.dtype.is_floating_point)
                seen[-1][layer] = torch.bincount(ids.reshape(-1), minlength=e)

            handles.append(s.experts.register_forward_pre_hook(pre))
    return seen, handles


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [t.detach().clone() for t in model.state_dict().values()]
    for st in opt.state.values():
        out += [v.detach().clone() for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) or (x.isnan() == y.isnan()).all() and torch.equal(x.nan_to_num(), y.nan_to_num())
        for x, y in zip(a, b, strict=True)
    )


def faulty_run(family: str, corpus: np.ndarray, steps: int, run_dir: Path, seed: int = 0) -> dict[str, Any]:
    model = build(family, seed=seed, aux_loss_coef=0.0)
    att = _attach(model, "sign")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guarded = GuardedStep(model, opt, attach=att, run_dir=run_dir, max_lr=3e-3, grad_clip=1.0)
    seen, handles = independent_loads(model, att)
    data = byte_batches(corpus, batch=4, seq=64, seed=seed)
    faults: dict[int, str] = {}
    t0 = time.perf_counter()
    for step in range(steps):
        x = next(data)
        seen.append({})
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        fault = step in SPIKES or step in NANS
        if step in SPIKES:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(50.0)
        if step in NANS:
            next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
        before = _state(model, opt) if fault else None
        d = guarded.step(loss, tokens=x.numel())
        if fault:
            unchanged = _same(before, _state(model, opt))  # type: ignore[arg-type]
            if d.action == "rollback":  # a third skip in 50 steps: an earlier snapshot restored
                faults[step] = "rollback"
            else:
                faults[step] = f"{d.action}{'' if unchanged else ' CHANGED'}"
    for h in handles:
        h.remove()
    guarded.close()
    s_per_step = (time.perf_counter() - t0) / steps
    stored = read_table(run_dir, "experts").sort("step", "layer", "expert")
    bad_loads = 0
    for (step, layer), g in stored.group_by(["step", "layer"], maintain_order=True):
        want = seen[1 + int(step)].get(int(layer))
        if want is None or not np.array_equal(g["load"].to_numpy().astype(np.int64), want.numpy()):
            bad_loads += 1
    st = read_table(run_dir, "steps")
    other = st.filter(~pl.col("step").is_in([*SPIKES, *NANS]) & (pl.col("action") != "apply"))
    ev = read_table(run_dir, "events")
    why = ev.filter(pl.col("step").is_in(other["step"].to_list()) & (pl.col("kind") == "verdict"))
    return {
        "loads_checked": stored.select(pl.struct("step", "layer").n_unique()).item(),
        "loads_bad": bad_loads,
        "faults": faults,
        "other_actions": other.select("step", "action").rows(),
        "other_why": why.select("step", "detector", "value", "threshold").rows(),
        "s_per_step": round(s_per_step, 4),
        "final_loss": round(float(st["loss"].tail(20).mean()), 3),
    }


def _learned_routing_layers(model: torch.nn.Module, layers: list[int]) -> list[int]:
    """The layers whose selection follows their router's logits: one dry forward with every
    logits projection scrambled changes their ids. DeepSeek-V4's first MoE layers route by a fixed
    token -> experts table, which no push on a router can move (the drill measured that, not the
    guard, when its middle layer was one). Falls back to all layers if none shows it."""
    blocks = decoder_layers(model)
    sites = {s.layer: s for s in rt.find_sites(blocks) if not s.attention and s.layer in layers}
    x = rt.dry_batch(model)

    def ids() -> dict[int, torch.Tensor]:
        return {k[0]: _ids_of(out) for k, (_, out, _) in rt.capture(model, list(sites.values()), x).items()}

    before = ids()
    lins = [lin for s in sites.values() if (lin := router_linear(s.router)) is not None]
    kept = [lin.weight.detach().clone() for lin in lins]
    g = torch.Generator().manual_seed(1)
    try:
        with torch.no_grad():
            for lin in lins:
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 10)
        after = ids()
    finally:
        with torch.no_grad():
            for lin, w in zip(lins, kept, strict=True):
                lin.weight.copy_(w)
    moved = [i for i in layers if i in before and i in after and not torch.equal(before[i], after[i])]
    return moved or layers


def _ids_of(out: Any) -> torch.Tensor:
    """Everything integer in a router's output, flattened (the ids it chose), else each float
    output's per-row argmax (DBRX hands back logits only)."""
    items = out if isinstance(out, tuple | list) else [out]
    tensors = [t for t in items if isinstance(t, torch.Tensor)]
    ints = [t.reshape(-1) for t in tensors if not t.dtype.is_floating_point]
    return torch.cat(ints or [t.argmax(-1).reshape(-1) for t in tensors])


def _back_after(maxvio_at: dict[int, float], at: int, first: int, steps: int, thr: float) -> int | None:
    """Steps from `at` until MaxVio (by step; steps without one are passed over) has been under
    `thr` for 5 steps running, counted to the first of them; None if not before `steps`."""
    run = 0
    for s in range(first, steps):
        if s not in maxvio_at:
            continue
        run = run + 1 if maxvio_at[s] < thr else 0
        if run == 5:
            return s - 4 - at
    return None


def collapse_run(
    family: str, corpus: np.ndarray, run_dir: Path, *, correct: bool, seed: int = 0
) -> dict[str, Any]:
    model = build(family, seed=seed, aux_loss_coef=0.0)
    att = _attach(model, "sign")
    layers = _learned_routing_layers(model, [i for i, _ in att.routers])
    for _, hook in att.routers:
        hook.reset_stats()  # the probe's dry forwards counted tokens
    layer = layers[len(layers) // 2]
    mode = att.correction_mode
    if not correct:
        att.corrector = None
    cfg = GuardConfig(collapse=CollapseConfig(warmup=40))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guarded = GuardedStep(model, opt, attach=att, run_dir=run_dir, config=cfg, max_lr=3e-3, grad_clip=1.0)
    data = byte_batches(corpus, batch=4, seq=64, seed=seed)
    at, steps = 60, 180
    for step in range(steps):
        if step == at:
            force_collapse(model, layer, margin=8.0)
        x = next(data)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        guarded.step(loss, tokens=x.numel())
    guarded.close()
    lay = read_table(run_dir, "layers").filter(pl.col("layer") == layer).sort("step")
    mv = lay["maxvio"].to_numpy()
    ev = read_table(run_dir, "events")
    detected = ev.filter((pl.col("kind") == "verdict") & (pl.col("step") >= at))["step"].min()
    thr, w = cfg.collapse.maxvio, cfg.collapse.maxvio_for
    back = _back_after(dict(zip(lay["step"].to_list(), mv.tolist(), strict=True)), at, at + 1, steps, thr)
    # the detector's own pooled rule (a layer that sends each batch to a few experts reads past
    # the line every step; its loads summed over the detector's window say whether it prefers one)
    ex = read_table(run_dir, "experts").filter(pl.col("layer") == layer).sort("step", "expert")
    load_at = {int(k[0]): g["load"].to_numpy() for k, g in ex.group_by("step", maintain_order=True)}
    pooled_at = {}
    for s in range(at + w, steps):
        window = [load_at[t] for t in range(s - w + 1, s + 1) if t in load_at]
        if window:
            pooled_at[s] = float(maxvio_and_entropy(np.sum(window, axis=0)[None, :])[0][0])
    back_pooled = _back_after(pooled_at, at, at + w, steps, thr)
    acts = read_table(run_dir, "steps").filter(pl.col("action") == "bias_correct")["step"].to_list()
    return {
        "layer": layer,
        "mode": mode,
        "detected": detected,
        "back_after": back,
        "back_after_pooled": back_pooled,
        "corrections": acts,
        "peak_maxvio": round(float(mv[at:].max()), 2),
    }


def family_row(family: str, corpus: np.ndarray, steps: int, quick: bool) -> dict[str, Any]:
    row: dict[str, Any] = {"family": family}
    model = build(family, seed=0)
    t0 = time.perf_counter()
    try:
        att = _attach(model, None)
    except ValueError as e:
        row.update(attach="refused", message=str(e)[:300])
        return row
    r = att.routers[0][1].reading
    row.update(
        attach="ok",
        attach_s=round(time.perf_counter() - t0, 2),
        form=r.form,
        experts=r.n_experts,
        top_k=r.top_k,
        score=r.score_func,
        correction=att.correction_mode,
        unobserved=len(att.unobserved),
    )
    att.remove()
    with tempfile.TemporaryDirectory() as tmp:
        row.update(faulty_run(family, corpus, 12 if quick else steps, Path(tmp) / "f"))
        if not quick:
            row["collapse"] = collapse_run(family, corpus, Path(tmp) / "c", correct=True)
            row["control"] = collapse_run(family, corpus, Path(tmp) / "n", correct=False)
    return row


def bias_updates(family: str, corpus: np.ndarray, steps: int) -> list[dict[str, Any]]:
    out = []
    for upd in ("smebu", "sign", None):
        model = build(family, seed=0, aux_loss_coef=0.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            att = attach(model, bias_update=upd)  # sign: u = 1e-3 (DeepSeek-V3's), SMEBU: Trinity's figures
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        cfg = GuardConfig(mode="observe")  # the balancing alone: no guard action on either run
        with tempfile.TemporaryDirectory() as tmp:
            guarded = GuardedStep(model, opt, attach=att, run_dir=Path(tmp) / "r", config=cfg, grad_clip=1.0)
            data = byte_batches(corpus, batch=4, seq=64, seed=0)
            for _ in range(steps):
                x = next(data)
                loss = model(input_ids=x, labels=x).loss
                loss.backward()
                guarded.step(loss, tokens=x.numel())
            guarded.close()
            lay = read_table(Path(tmp) / "r", "layers").filter(pl.col("step") >= steps - 100)
            st = read_table(Path(tmp) / "r", "steps")
            bias = read_table(Path(tmp) / "r", "layers").filter(pl.col("step") == steps - 1)
        per_layer = lay.group_by("layer").agg(pl.col("maxvio").mean()).sort("layer")
        out.append(
            {
                "family": family,
                "bias_update": upd or "none",
                "maxvio_last100": {int(a): round(float(b), 3) for a, b in per_layer.iter_rows()},
                "final_loss": round(float(st["loss"].tail(20).mean()), 3),
                "bias_norm_end": {
                    int(a): round(float(b), 4) for a, b in bias.select("layer", "bias_norm").iter_rows()
                },
            }
        )
    return out


def table(paths: list[Path]) -> str:
    rows = [json.loads(line) for p in paths for line in p.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "attach" in r]
    lines = [
        "| family | attach | form (experts, top-k, score) | correction | loads equal | x50 / NaN at 30, 150, 400 "
        "| other actions | collapse back under threshold, corrected / control (steps) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: r["family"]):
        if r["attach"] != "ok":
            lines.append(f"| {r['family']} | refused: {r['message'][:120]} | - | - | - | - | - | - |")
            continue
        loads = f"{r['loads_checked'] - r['loads_bad']}/{r['loads_checked']}"
        f = r.get("faults", {})
        faults = ", ".join(f"{v}" for _, v in sorted(f.items(), key=lambda kv: int(kv[0]))) or "-"
        if f and all(v == "skip" for v in f.values()):
            faults = f"all {len(f)} skipped, state bitwise unchanged"
        other = r.get("other_actions")
        kinds = Counter(a for _, a in other or [])
        other_s = (
            "-"
            if other is None
            else (f"{len(other)} (" + ", ".join(f"{a} {n}" for a, n in kinds.items()) + ")" if other else "0")
        )
        c, n = r.get("collapse"), r.get("control")
        coll = (
            "not run"
            if c is None
            else f"{c['back_after']} / {n['back_after']} (bias_correct at {c['corrections'][:2]})"
        )
        if c is not None and c["back_after"] is None and c.get("back_after_pooled") is not None:
            # per-step MaxVio never under the line (each batch to a few experts): the pooled rule
            coll = (
                f"pooled over 10 steps: {c['back_after_pooled']} / {n.get('back_after_pooled')} "
                f"(bias_correct at {c['corrections'][:2]})"
            )
        lines.append(
            f"| {r['family']} | ok | {r['form']} ({r['experts']}, {r['top_k']}, {r['score']}) | {r['correction']} "
            f"| {loads} | {faults} | {other_s} | {coll} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(ALL_FAMILIES), help="comma-separated (default: all)")
    ap.add_argument("--steps", type=int, default=420, help="steps of the faulty run (>= 402)")
    ap.add_argument("--quick", action="store_true", help="attach and a 12-step load check only")
    ap.add_argument("--bias-updates", metavar="FAMILY", help="SMEBU vs sign vs none on FAMILY over --steps")
    ap.add_argument("--out", type=Path, help="append one JSON line per family here")
    ap.add_argument("--table", nargs="+", type=Path, help="print the Markdown table of these result files")
    a = ap.parse_args(argv)
    if a.table:
        print(table(a.table))
        return 0
    from trainer.data import stdlib_corpus

    torch.set_num_threads(1)
    corpus = stdlib_corpus(4_000_000)
    if a.bias_updates:
        rows = bias_updates(a.bias_updates, corpus, a.steps)
    else:
        rows = []
        for fam in a.families.split(","):
            rows.append(family_row(fam, corpus, a.steps, a.quick))
            print(json.dumps(rows[-1]), flush=True)
            if a.out:
                with a.out.open("a") as f:
                    f.write(json.dumps(rows[-1]) + "\n")
        return 0
    for r in rows:
        print(json.dumps(r), flush=True)
    if a.out:
        with a.out.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
