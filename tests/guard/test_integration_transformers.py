"""The guard on transformers 5 MoE families it did not write (tiny, random init, CPU).

For every family: the stored loads are the router's real top-k counts (read independently, from
what the experts module was handed), a grad spike and a NaN are skipped with every weight,
buffer and AdamW state bitwise unchanged, a forced collapse is detected and corrected through
the model (selection bias or per-layer balancing gradient), and a clean run takes no action.
The clean run and the collapse are one run per family (`long_runs`): the collapse is forced
after the clean steps, once every detector is armed.
"""

from __future__ import annotations

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
from guard.core.config import GuardConfig  # noqa: E402
from guard.integrations.tiny import FAMILIES, build  # noqa: E402
from guard.integrations.transformers import _router_of, attach, decoder_layers  # noqa: E402
from guard.store.reader import read_table  # noqa: E402

pytestmark = [pytest.mark.slow]

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
# JetMoE's clean seed-5 run rises 6.7x its level in every layer at once at step 221 (the calibrated
# threshold there is 6.4x): a natural excursion the whole-model rule skips. Its figure is pinned by
# test_jetmoe_clean_run_draws_one_natural_skip instead of a zero-action claim (issue #28's trade).
CLEAN_CLAIMED = tuple(f for f in COLLAPSE_CLAIMED if f != "jetmoe")
# Natural early excursions that the default early cap (8x, guard/core/config.py) skips on these
# clean seeds: every layer rose past 8x its own level at once with no fault, inside the runs'
# first-40-step transient (lr 3e-3 from step 0, no warm-up): issue #28's trade, measured on 54
# families in docs/BENCHMARKS.md ("Early-run spikes"). Pinned step for step, so a change in
# either direction shows.
NATURAL_SKIPS = {
    5: {"mixtral": [29], "afmoe": [23], "ernie4_5_moe": [35, 36]},  # test_clean_run_takes_no_action
    2: {"olmoe": [21], "qwen3_moe": [21]},  # test_spike_and_nan_are_skipped_...
}


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


@pytest.mark.parametrize("family", FAMILIES + SUBSET)
def test_spike_and_nan_are_skipped_with_all_state_bitwise_unchanged(
    family: str, corpus: np.ndarray, tmp_path: Path
) -> None:
    model = build(family, seed=2)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guarded = GuardedStep(model, opt, attach=attach(model), run_dir=tmp_path / "run", grad_clip=1.0)
    data = byte_batches(corpus, batch=4, seq=64, seed=2)
    faults = {40: "spike", 43: "nan"}
    natural = NATURAL_SKIPS[2].get(family, [])
    for step in range(46):
        x = next(data)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        if step in faults:
            if faults[step] == "spike":
                for p in model.parameters():
                    if p.grad is not None:  # afmoe's expert_bias is a parameter without a gradient
                        p.grad.mul_(1000.0)
            else:
                next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
            state = {k: v.clone() for k, v in model.state_dict().items()}
            opt_state = [
                {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for s in opt.state.values()
            ]
        d = guarded.step(loss, tokens=x.numel())
        if step in faults:
            assert d.action == schema.ACT_SKIP, (family, step, [v.detector for v in d.verdicts])
            assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
            for before, after in zip(opt_state, opt.state.values(), strict=True):
                assert all(
                    torch.equal(v, after[k]) if torch.is_tensor(v) else v == after[k]
                    for k, v in before.items()
                )
        else:
            want = schema.ACT_SKIP if step in natural else schema.ACT_APPLY
            assert d.action == want, (family, step, [(v.detector, v.value) for v in d.verdicts])
    guarded.close()
    steps = read_table(tmp_path / "run", "steps").sort("step")
    assert steps.filter(pl.col("action") == "skip")["step"].to_list() == sorted([40, 43, *natural])


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
    """The clean steps' (before the collapse) actions, events and final loss, as drill() reports them."""
    steps = read_table(run_dir, "steps").filter(pl.col("step") < CLEAN_STEPS).sort("step")
    events = read_table(run_dir, "events").filter(pl.col("step") < CLEAN_STEPS)
    assert steps["step"].to_list() == list(range(CLEAN_STEPS))
    actions = steps.filter(pl.col("action") != "apply").select("step", "action").rows()
    rows = events.select("step", "kind", "detector", "action", "value", "threshold").rows()
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
    # corrected, no update thrown away: every step applied but the clean part's pinned natural skips
    steps = read_table(run_dir, "steps").sort("step")
    thrown = steps.filter(~pl.col("action").is_in(list(schema.APPLYING_ACTIONS)))["step"].to_list()
    natural = NATURAL_SKIPS[5].get(family, [221] if family == "jetmoe" else [])
    assert thrown == natural, thrown
    # each correction is its step's action, counted once (guard/core/actions.py)
    assert steps.filter(pl.col("action") == schema.ACT_BIAS_CORRECT)["step"].to_list() == sorted(
        set(acts["step"].to_list())
    )


@pytest.mark.parametrize("family", CLEAN_CLAIMED)
def test_clean_run_takes_no_action(family: str, long_runs: LongRuns) -> None:
    """No action, but for the pinned natural early skips (NATURAL_SKIPS): each a whole-model rise
    over the early cap, judged by the grad-norm rule and skipped alone (no escalation)."""
    actions, events, final_loss = _clean_part(long_runs(family)[0])
    natural = NATURAL_SKIPS[5].get(family, [])
    assert actions == [(s, schema.ACT_SKIP) for s in natural], events
    verdicts = [e for e in events if e[1] != schema.EV_CHECKPOINT]
    assert [(e[0], e[1], e[2], e[3]) for e in verdicts] == [
        (s, schema.EV_VERDICT, schema.DET_GRAD_SPIKE, schema.ACT_SKIP) for s in natural
    ], events
    assert all(e[4] > e[5] == GuardConfig().grad_spike.all_layers_early_cap for e in verdicts)
    assert final_loss < 3.0  # it trained (bytes start at ln 256 = 5.5)


def test_jetmoe_clean_run_draws_one_natural_skip(long_runs: LongRuns) -> None:
    _, events, final_loss = _clean_part(long_runs("jetmoe")[0])
    assert [(e[0], e[2], e[3]) for e in events if e[1] == schema.EV_VERDICT] == [
        (221, schema.DET_GRAD_SPIKE, schema.ACT_SKIP)
    ], events
    assert final_loss < 3.0


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
