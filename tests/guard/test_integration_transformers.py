"""The guard on transformers 5 MoE families it did not write (tiny, random init, CPU).

For every family: the stored loads are the router's real top-k counts (read independently, from
what the experts module was handed), a grad spike is flagged and kept under the default policy
(clip_spikes: the update the unguarded run takes, its clip looser than the grad clip) and a NaN
skipped with every weight, buffer and AdamW state bitwise unchanged (the spike skipped too with
clip_spikes off), a forced collapse is detected and corrected through the model (selection bias
or per-layer balancing gradient), and a clean run takes no action.
The clean run and the collapse are one run per family (`long_runs`): the collapse is forced
after the clean steps, once every detector is armed.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch

pytest.importorskip("transformers")

from bench.drills.real_models import byte_batches, drill  # noqa: E402
from guard.api import GuardedStep  # noqa: E402
from guard.core import schema  # noqa: E402
from guard.core.config import GuardConfig, PolicyConfig  # noqa: E402
from guard.integrations.tiny import FAMILIES, build  # noqa: E402
from guard.integrations.transformers import _router_of, attach, decoder_layers  # noqa: E402
from guard.store.reader import read_table  # noqa: E402

pytestmark = [pytest.mark.slow]
CLIPPABLE = (schema.DET_GRAD_SPIKE, schema.DET_LAYER_GRAD_SPIKE)  # the verdicts a clip can answer

# The long drills' representative subset of the other shapes (issue #28; every family's attach, dry
# forward and load check: test_integration_matrix.py): Llama4's scores mask, DBRX's experts input,
# JetMoE's counts, afmoe's sigmoid router and block bias, ernie's moe_statics bias, LongCat-Flash's
# zero-computation experts
SUBSET = ("afmoe", "llama4_text", "dbrx", "jetmoe", "ernie4_5_moe", "longcat_flash")
BIASED = ("deepseek_v3", "afmoe", "ernie4_5_moe", "longcat_flash")
# LongCat-Flash's zero-computation experts take a share of the tokens that reads as a collapse on
# its own clean runs (MaxVio 3.8-3.9 over its 10 bins at steps 266-277), and the bias correction
# does not bring it back (docs/NOTES.md, issue #28): its attach, loads, spikes and NaN are checked
# above; collapse handling and a clean run without action are not claimed for it.
COLLAPSE_CLAIMED = tuple(f for f in (*FAMILIES, *SUBSET) if f != "longcat_flash")
# JetMoE too since clip_spikes is the default: its natural spike at 221, a skip before, is now
# applied within the grad clip (NATURAL_MAX)
CLEAN_CLAIMED = COLLAPSE_CLAIMED
# Natural excursions on these clean seeds that the whole-model (all-layers) rule flags: every layer
# rose past the early cap (8x its own level, guard/core/config.py) at once with no fault, inside
# the runs' first-40-step transient (lr 3e-3 from step 0, no warm-up; issue #28's trade, measured
# on 54 families in docs/BENCHMARKS.md, "Early-run spikes"), and JetMoE's seed-5 run 6.7x at step
# 221 (its calibrated threshold there 6.4x). Under the default policy (clip_spikes) each is a
# grad-norm verdict whose clip at the threshold is looser than the runs' grad clip (1.0): the step
# is the unguarded one (its row says apply, the verdict's action none, `within_grad_clip`), no
# update thrown away, no guard action. With clip_spikes off each is a skip.
# Where they fall is float rounding's: the CPU's kernels (AVX2 or AVX-512, MKL's path per vendor)
# move these transients by a step or across the line. The 2-vCPU VMs these were first pinned on
# read, on the long runs (seed 5), mixtral 29, afmoe 23, ernie4_5_moe 35 (9.4x; and 36
# after a skip of 35, from an applied 35 not), jetmoe 221, and on the spike-and-NaN runs (seed 2)
# olmoe 21, qwen3_moe 21; an AVX-512 Xeon (torch's cpu capability AVX512) read mixtral's and
# JetMoE's under the line and afmoe's at 23 and 31. So the tests pin the kind of each natural
# verdict and bound how many there are, not their steps: a detector that grows false positives
# still fails, on any CPU.
NATURAL_MAX = 2  # natural verdicts a run may hold (the most any host has read: 2)
EARLY = 40  # the transient: the whole-model rule's early cap applies before this step


def natural_ok(steps: list[int]) -> bool:
    """A run's natural verdict steps are few: at most NATURAL_MAX, at most one after the transient."""
    return len(steps) <= NATURAL_MAX and sum(s >= EARLY for s in steps) <= 1


@pytest.fixture(scope="module")
def corpus() -> np.ndarray:
    from trainer.data import stdlib_corpus

    torch.set_num_threads(1)
    return stdlib_corpus(2_000_000)


def _experts_input_counts(model: torch.nn.Module) -> tuple[dict[int, list[torch.Tensor]], list]:
    """Per layer, the top-k index tensor each experts module RECEIVED (its forward input): the
    routing the model applied, observed independently of the guard's router hook."""
    seen: dict[int, list[torch.Tensor]] = {}
    handles = []
    for i, blk in enumerate(decoder_layers(model)):
        moe = next((m for m in blk.modules() if _router_of(m) is not None), None)
        if moe is None:
            continue
        n_exp = moe.experts.num_experts if hasattr(moe.experts, "num_experts") else 8

        def pre(mod, args, kwargs, i=i, n_exp=n_exp):
            idx = (
                args[1]
                if len(args) > 1
                else next(v for v in kwargs.values() if not v.dtype.is_floating_point)
            )
            seen.setdefault(i, []).append(torch.bincount(idx.reshape(-1), minlength=n_exp))

        handles.append(moe.experts.register_forward_pre_hook(pre, with_kwargs=True))
    return seen, handles


@pytest.mark.parametrize("family", FAMILIES)
def test_stored_loads_are_the_routers_real_top_k(family: str, corpus: np.ndarray, tmp_path: Path) -> None:
    model = build(family, seed=1)
    if family == "deepseek_v3":  # a non-zero selection bias and group-limited routing (4 groups, top-2)
        for blk in decoder_layers(model):
            r = _router_of(blk.mlp) if hasattr(blk, "mlp") else None
            if r is not None:
                r.e_score_correction_bias.normal_(0, 0.05)
        assert model.config.n_group == 4 and model.config.topk_group == 2
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    att = attach(model)  # its dry forwards run before the independent observer goes on
    seen, handles = _experts_input_counts(model)
    guarded = GuardedStep(model, opt, attach=att, run_dir=tmp_path / "run", grad_clip=1.0)
    data = byte_batches(corpus, batch=4, seq=64, seed=1)
    steps = 12
    for _ in range(steps):
        x = next(data)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        guarded.step(loss, tokens=x.numel())
    guarded.close()
    for h in handles:
        h.remove()
    stored = read_table(tmp_path / "run", "experts").sort("step", "layer", "expert")
    layers = sorted(seen)
    assert sorted(stored["layer"].unique().to_list()) == layers
    for layer in layers:
        assert len(seen[layer]) == steps  # one forward per step
        want = torch.stack(seen[layer]).numpy()
        got = stored.filter(pl.col("layer") == layer).pivot(on="expert", index="step", values="load")
        got = got.sort("step").drop("step").to_numpy()
        np.testing.assert_array_equal(got, want, err_msg=f"{family} layer {layer}")


FAULTS = {40: "spike", 43: "nan"}  # x1000 on every gradient; a NaN in one


def _spike_and_nan_run(family: str, corpus: np.ndarray, run_dir: Path, config: GuardConfig) -> dict:
    """Seed 2's 46 guarded steps (grad clip 1.0), FAULTS injected into the gradients after the
    backward. Returns each step's decision; per fault step whether every weight, buffer and AdamW
    state came out bitwise unchanged ("unchanged"), and whether the weights and AdamW state equal
    the update the same step takes with the guard observing only ("unguarded"): computed on
    copies of the parameters, gradients and AdamW state from just before the guard's step, the
    gradient clipped to 1.0 by torch.nn.utils.clip_grad_norm_, then AdamW's step."""
    model = build(family, seed=2)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guarded = GuardedStep(model, opt, attach=attach(model), run_dir=run_dir, grad_clip=1.0, config=config)
    data = byte_batches(corpus, batch=4, seq=64, seed=2)
    out: dict = {"decisions": {}, "unchanged": {}, "unguarded": {}}
    for step in range(46):
        x = next(data)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        if step in FAULTS:
            if FAULTS[step] == "spike":
                for p in model.parameters():
                    if p.grad is not None:  # afmoe's expert_bias is a parameter without a gradient
                        p.grad.mul_(1000.0)
            else:
                next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
            state = {k: v.clone() for k, v in model.state_dict().items()}
            opt_state = [
                {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for s in opt.state.values()
            ]
            params = [p for p in model.parameters() if p.grad is not None]
            ref = [p.detach().clone().requires_grad_() for p in params]
            for r, p in zip(ref, params, strict=True):
                r.grad = p.grad.detach().clone()
            ref_opt = torch.optim.AdamW(ref, lr=3e-3)
            for r, p in zip(ref, params, strict=True):
                ref_opt.state[r] = {k: v.clone() for k, v in opt.state[p].items()}
            torch.nn.utils.clip_grad_norm_(ref, 1.0)
            ref_opt.step()
        d = guarded.step(loss, tokens=x.numel())
        out["decisions"][step] = d
        if step in FAULTS:
            out["unchanged"][step] = all(
                torch.equal(state[k], v) for k, v in model.state_dict().items()
            ) and all(
                torch.equal(v, after[k]) if torch.is_tensor(v) else v == after[k]
                for before, after in zip(opt_state, opt.state.values(), strict=True)
                for k, v in before.items()
            )
            # weights: float32 rounding of w - update (the guard's norm and torch's differ in the
            # last bits), far below a step's size (~lr); AdamW's moments: relative, normwise
            moments = [
                (v, ref_opt.state[r][k])
                for p, r in zip(params, ref, strict=True)
                for k, v in opt.state[p].items()
            ]
            out["unguarded"][step] = (
                max((p - r).abs().max().item() for p, r in zip(params, ref, strict=True)),
                max(((v - w).norm() / w.norm()).item() for v, w in moments if v.ndim),
                all(torch.equal(v, w) for v, w in moments if not v.ndim),  # AdamW's step counts
            )
    guarded.close()
    # the steps with verdicts and no fault: natural excursions (NATURAL_MAX)
    out["natural"] = [s for s, d in out["decisions"].items() if s not in FAULTS and d.verdicts]
    out["steps"] = read_table(run_dir, "steps").sort("step")
    out["events"] = read_table(run_dir, "events").filter(pl.col("kind") == schema.EV_VERDICT).sort("step")
    return out


@pytest.mark.parametrize("family", FAMILIES + SUBSET)
def test_a_grad_spike_is_kept_and_a_nan_skipped_with_all_state_bitwise_unchanged(
    family: str, corpus: np.ndarray, tmp_path: Path
) -> None:
    """What a user gets by default (clip_spikes): the x1000 spike is flagged and kept; its clip at
    the detector's threshold is looser than the grad clip, so the step is the unguarded one
    (applied, the weights and AdamW state those of the guard observing only, no guard action).
    The NaN is skipped with every weight, buffer and AdamW state bitwise unchanged."""
    run = _spike_and_nan_run(family, corpus, tmp_path / "run", GuardConfig())
    spike, nan = run["decisions"][40], run["decisions"][43]
    why = (family, spike.action, [(v.detector, v.value) for v in spike.verdicts])
    assert spike.action == schema.ACT_APPLY, why  # not clip: the grad clip (1.0) is the tighter
    assert spike.verdicts and {v.detector for v in spike.verdicts} <= set(CLIPPABLE), spike.verdicts
    assert not run["unchanged"][40]  # the update landed
    weights, moments, counts = run["unguarded"][40]  # the observing guard's update, to rounding
    assert weights < 1e-7 and moments < 1e-6 and counts, (weights, moments, counts)
    assert nan.action == schema.ACT_SKIP and run["unchanged"][43], (family, nan.action, nan.verdicts)
    natural = run["natural"]  # where they fall is the CPU's rounding: few, and kept
    assert natural_ok(natural), (family, natural)
    for step, d in run["decisions"].items():
        if step not in FAULTS:
            why = (family, step, d.action, [(v.detector, v.value) for v in d.verdicts])
            assert d.action == schema.ACT_APPLY, why
            assert {v.detector for v in d.verdicts} <= set(CLIPPABLE), why
    # the run store: the NaN the one step not applied; each grad-norm verdict recorded with action
    # none, its clip named as within the grad clip (guard/runtime/apply.py)
    steps, verdicts = run["steps"], run["events"]
    assert steps.filter(pl.col("action") != schema.ACT_APPLY).select("step", "action").rows() == [
        (43, "skip")
    ]
    kept = verdicts.filter(pl.col("step") != 43)
    assert sorted(set(kept["step"].to_list())) == sorted([40, *natural]), kept
    assert set(kept["action"].to_list()) == {schema.ACT_NONE}, kept
    assert all(json.loads(x)["within_grad_clip"] == 1.0 for x in kept["detail"]), kept["detail"]
    assert schema.DET_NONFINITE in verdicts.filter(pl.col("step") == 43)["detector"].to_list()


@pytest.mark.parametrize("family", ["olmoe"])
def test_spike_and_nan_are_skipped_with_all_state_bitwise_unchanged(
    family: str, corpus: np.ndarray, tmp_path: Path
) -> None:
    """The skip path, with clip_spikes off (the default clips a finite grad spike; off restores the
    skip, and every NaN and loss spike takes it): the spike, the NaN and the natural spikes
    (NATURAL_MAX) are skipped, every weight, buffer and AdamW state bitwise unchanged at the faults."""
    cfg = GuardConfig(policy=PolicyConfig(clip_spikes=False))
    run = _spike_and_nan_run(family, corpus, tmp_path / "run", cfg)
    natural = run["natural"]
    assert natural_ok(natural), natural  # olmoe's at 21 where first pinned
    for step, d in run["decisions"].items():
        want = schema.ACT_SKIP if step in FAULTS or step in natural else schema.ACT_APPLY
        assert d.action == want, (family, step, [(v.detector, v.value) for v in d.verdicts])
    assert run["unchanged"] == {40: True, 43: True}
    skipped = run["steps"].filter(pl.col("action") == "skip")["step"].to_list()
    assert skipped == sorted([40, 43, *natural])


# One guarded run per family (seed 5, GuardConfig's defaults) serves both the clean-run claim and
# the collapse claim: clean for CLEAN_STEPS steps, long enough for every detector to be armed (the
# spike rules' tail fit from 200 accepted steps, the collapse detector from collapse.warmup = 250,
# its MaxVio rule 10 steps later), then every token of one MoE layer forced to expert 0 at
# CLEAN_STEPS. The correction opens ~10 steps later and is confirmed recovered at the end of its
# window (policy.bias_boost_steps = 50); the run goes on for the 20 steps judged after that.
CLEAN_STEPS = 310
COLLAPSE_STEPS = 90
LongRuns = Callable[[str], tuple[Path, int, float]]


@pytest.fixture(scope="module")
def long_runs(corpus: np.ndarray, tmp_path_factory: pytest.TempPathFactory) -> LongRuns:
    """family -> (run dir, the collapsed layer, its largest MaxVio), each run made once."""
    runs: dict[str, tuple[Path, int, float]] = {}

    def get(family: str) -> tuple[Path, int, float]:
        if family not in runs:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                att = attach(build(family, seed=0))
            moe = [i for i, _ in att.routers]
            layer = 2 if 2 in moe else moe[len(moe) // 2]
            reading = getattr(att.routers[0][1], "reading", None)
            top = att.n_experts / (reading.top_k if reading else att.top_k) - 1  # every token to expert 0
            run_dir = tmp_path_factory.mktemp(family) / "run"
            drill(
                family,
                seed=5,
                steps=CLEAN_STEPS + COLLAPSE_STEPS,
                corpus=corpus,
                run_dir=run_dir,
                injections=[("collapse", CLEAN_STEPS, layer)],
            )
            runs[family] = run_dir, layer, top
        return runs[family]

    return get


def _clean_part(run_dir: Path) -> tuple[list[tuple], list[tuple], float]:
    """The clean steps' (before the collapse) actions, events (step, kind, detector, action, value,
    threshold, detail) and final loss, as drill() reports them."""
    steps = read_table(run_dir, "steps").filter(pl.col("step") < CLEAN_STEPS).sort("step")
    events = read_table(run_dir, "events").filter(pl.col("step") < CLEAN_STEPS)
    assert steps["step"].to_list() == list(range(CLEAN_STEPS))
    actions = steps.filter(pl.col("action") != "apply").select("step", "action").rows()
    rows = events.select("step", "kind", "detector", "action", "value", "threshold", "detail").rows()
    return actions, rows, float(steps["loss"].tail(20).mean())


@pytest.mark.parametrize("family", COLLAPSE_CLAIMED)
def test_forced_collapse_is_detected_and_corrected(family: str, long_runs: LongRuns) -> None:
    run_dir, layer, top = long_runs(family)
    at = CLEAN_STEPS
    threshold = GuardConfig().collapse.maxvio
    events = read_table(run_dir, "events")
    maxvio = read_table(run_dir, "layers").filter(pl.col("layer") == layer).sort("step")["maxvio"]
    assert maxvio.len() == CLEAN_STEPS + COLLAPSE_STEPS
    assert maxvio[at] >= 0.9 * top  # (nearly) every token to expert 0: the largest MaxVio is E / k - 1
    acts = events.filter((pl.col("kind") == schema.EV_ACTION) & (pl.col("action") == schema.ACT_BIAS_CORRECT))
    assert acts.height >= 1 and acts["step"].min() > at, acts
    detail = acts["detail"][0]
    assert f'"layer": {layer}' in detail and ('"mode": "bias"' in detail) == (family in BIASED), detail
    rec = events.filter(pl.col("kind") == schema.EV_RECOVERED)
    assert rec.height >= 1
    recovered = rec["step"].min()
    assert recovered + 20 <= maxvio.len(), recovered  # 20 steps to judge after the recovery
    assert float(maxvio.slice(recovered, 20).median()) < threshold
    # corrected, no update thrown away: every step applied (the clean part's natural spikes too:
    # within the grad clip)
    steps = read_table(run_dir, "steps").sort("step")
    thrown = steps.filter(~pl.col("action").is_in(list(schema.APPLYING_ACTIONS)))["step"].to_list()
    assert thrown == [], thrown
    # each correction is its step's action, counted once (guard/core/actions.py)
    assert steps.filter(pl.col("action") == schema.ACT_BIAS_CORRECT)["step"].to_list() == sorted(
        set(acts["step"].to_list())
    )


@pytest.mark.parametrize("family", CLEAN_CLAIMED)
def test_clean_run_takes_no_action(family: str, long_runs: LongRuns) -> None:
    """No action, and no update thrown away. The natural spikes (NATURAL_MAX) are each
    a whole-model rise judged by the grad-norm rule: its verdict recorded, its clip looser than
    the grad clip, so the step is applied as the unguarded run's (action none, within_grad_clip)."""
    actions, events, final_loss = _clean_part(long_runs(family)[0])
    assert actions == [], events
    verdicts = [e for e in events if e[1] != schema.EV_CHECKPOINT]
    # few, wherever this CPU's rounding put them, and each a kept grad-norm verdict
    assert natural_ok([e[0] for e in verdicts]), events
    assert all(e[1:4] == (schema.EV_VERDICT, schema.DET_GRAD_SPIKE, schema.ACT_NONE) for e in verdicts), (
        events
    )
    assert all(json.loads(e[6])["within_grad_clip"] == 1.0 for e in verdicts), verdicts
    assert all(e[4] > e[5] for e in verdicts), verdicts
    # the early ones over the early cap; JetMoE's at 221 over its calibrated threshold (6.4x)
    cap = GuardConfig().grad_spike.all_layers_early_cap
    assert [e[5] == cap for e in verdicts] == [e[0] < EARLY for e in verdicts], verdicts
    assert final_loss < 3.0  # it trained (bytes start at ln 256 = 5.5)


def test_a_model_without_a_router_is_refused_by_name() -> None:
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    with pytest.raises(ValueError, match="LlamaForCausalLM: no MoE router"):
        attach(tf.AutoModelForCausalLM.from_config(cfg))


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_router_entropy_is_the_token_mean_from_a_bounded_sample(score_func: str) -> None:
    """count_pending takes the entropy over a fixed-stride sample of at most ENTROPY_TOKENS tokens
    (loads over every token): below the cap it is exactly the full mean, above it within 1% of
    it on a router whose tokens range from confident to undecided, and the loads stay exact."""
    from guard.integrations.base import ENTROPY_TOKENS, TopKRoutingHook, score_entropy_sum

    gen = torch.Generator().manual_seed(0)
    e, k = 8, 2
    for n in (ENTROPY_TOKENS // 2, ENTROPY_TOKENS * 16):
        # per-token temperature from 0.05 to 20: entropies spread over most of [0, log E]
        logits = torch.randn(n, e, generator=gen) / torch.logspace(-1.3, 1.3, n).unsqueeze(1)
        idx = logits.topk(k, dim=-1).indices

        hook = TopKRoutingHook(_FixedGate(logits, idx), n_experts=e, score_func=score_func)
        hook.router(torch.zeros(1))
        full_mean = score_entropy_sum(logits, score_func).item() / n
        mean = (hook.entropy_sum / hook.token_count).item()
        assert hook.token_count.item() == min(n, ENTROPY_TOKENS)
        if n <= ENTROPY_TOKENS:
            assert mean == pytest.approx(full_mean, rel=1e-6)
        else:
            assert mean == pytest.approx(full_mean, rel=0.01)
        assert torch.equal(hook.tokens_per_expert_E, torch.bincount(idx.reshape(-1), minlength=e).float())


class _FixedGate(torch.nn.Module):
    """A router whose forward returns transformers 5's (logits, weights, top-k indices), fixed."""

    def __init__(self, logits: torch.Tensor, idx: torch.Tensor) -> None:
        super().__init__()
        self.logits, self.idx = logits, idx

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.logits, self.logits.softmax(-1), self.idx


@pytest.mark.parametrize("with_bias", [False, True])
def test_the_probe_reads_routers_counted_together_and_one_by_one_alike(with_bias: bool) -> None:
    """The probe ships the stacked results of count_pending when every router was counted in one
    batch with one forward (the usual step), else each router's accumulators: two forwards per
    step (micro-batches), or a router read on its own before the probe. The numbers match an
    independent count either way, and the selection biases (a constant zero vector for routers
    that have none) come through."""
    from guard.integrations.base import TopKRoutingHook, count_pending, counted_together, score_entropy_sum
    from guard.runtime.probe import Probe

    gen = torch.Generator().manual_seed(0)
    e, n = 8, 96
    gates = []
    for _ in range(3):
        logits = torch.randn(n, e, generator=gen)
        gates.append(_FixedGate(logits, logits.topk(2, dim=-1).indices))
    biases = [torch.randn(e, generator=gen) if with_bias else None for _ in gates]
    hooks = [TopKRoutingHook(g, n_experts=e, bias=b) for g, b in zip(gates, biases, strict=True)]
    lin = torch.nn.Linear(4, 4)
    probe = Probe(
        lin, dead_window=5, device=torch.device("cpu"), layers=[lin], routers=list(enumerate(hooks))
    )
    want_loads = np.stack([np.bincount(g.idx.reshape(-1), minlength=e) for g in gates])
    want_ent = np.array([score_entropy_sum(g.logits, "softmax").item() / n for g in gates])
    want_bias = np.stack([b.numpy() for b in biases]) if with_bias else np.zeros((3, e))
    for forwards, read_one_first in ((1, False), (2, False), (1, True), (1, False)):
        probe.reset_router_stats()
        for _ in range(forwards):
            for g in gates:
                g(torch.zeros(1))
        if read_one_first:
            assert hooks[1].tokens_per_expert_E.sum() == 2 * n  # counted on its own, read as views
        lin(torch.ones(4)).sum().backward()
        count_pending(hooks)
        assert (counted_together(hooks) is not None) == (forwards == 1 and not read_one_first)
        pr = probe.collect(torch.tensor(1.0), 1)
        np.testing.assert_array_equal(pr.load_ME, forwards * want_loads)
        np.testing.assert_allclose(pr.router_entropy_M, want_ent, rtol=1e-6)
        np.testing.assert_array_equal(pr.bias_ME, want_bias.astype(np.float32))
        lin.zero_grad()
