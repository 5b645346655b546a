"""The torchtitan adapter on a real torchtitan DeepSeek-V3 (random init, CPU, fp32): stored loads are
torchtitan's own counters, bad steps are skipped bit-exactly, a forced collapse is corrected through
torchtitan's `expert_bias_E`, and a clean run draws no action.

The model is torchtitan's DeepSeek-V3 built from its own config builders (bench/common/torchtitan_model.py's
"small", shared with bench/overhead/torchtitan_overhead.py), smaller than `debugmodel`
(dim 64, 4 blocks: 1 dense + 3 MoE, 8 experts top-2, softmax scores, expert_bias_E), with
torchtitan's own ScaledDotProductAttention as inner attention: torchtitan refuses "sdpa" for
language models, FlexAttention has no CPU backward and varlen needs CUDA. torchtitan's own
aux-loss-free balancing hook (`register_moe_load_balancing_hook`) runs on the AdamW, as in its
Trainer; its ParallelDims needs a process group, so a one-process gloo group is started.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from torch import nn

pytest.importorskip(
    "torchtitan", reason="torchtitan (and triton) not installed: pip install torchtitan==0.3.0 triton"
)

from bench.common.torchtitan_model import SMALL_VOCAB, build, one_process_group, small_config  # noqa: E402
from guard.api import GuardedStep  # noqa: E402
from guard.core import schema  # noqa: E402
from guard.core.config import GuardConfig, PolicyConfig  # noqa: E402
from guard.integrations.torchtitan import attach, force_collapse  # noqa: E402
from guard.store.reader import read_table  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.integration]

VOCAB, BATCH, SEQ = SMALL_VOCAB, 8, 64


def model_config() -> object:
    """The small DeepSeekV3Model.Config (bench/common/torchtitan_model.py), with its own SDPA inner attention."""
    return small_config(max_seq_len=SEQ)


def build_model(seed: int = 0) -> nn.Module:
    return build(model_config(), seed=seed)


@pytest.fixture(scope="module")
def corpus() -> np.ndarray:
    from trainer.data import stdlib_corpus

    torch.set_num_threads(1)
    return stdlib_corpus(1 << 20)


@pytest.fixture(scope="module")
def parallel_dims() -> Iterator[object]:
    with one_process_group() as dims:
        yield dims


class Run:
    """A plain loop on the torchtitan model: AdamW + torchtitan's bias hook + GuardedStep."""

    def __init__(
        self,
        run_dir: Path,
        corpus: np.ndarray,
        parallel_dims: object | None,
        config: GuardConfig | None = None,
    ) -> None:
        from torchtitan.components.optimizer import register_moe_load_balancing_hook

        self.model = build_model()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
        if parallel_dims is not None:
            register_moe_load_balancing_hook(self.opt, [self.model], parallel_dims)
        self.att = attach(self.model)
        self.guarded = GuardedStep(self.model, self.opt, attach=self.att, run_dir=run_dir, config=config)
        self.moes = {i: src.moe for i, src in self.att.routers}
        self.corpus = torch.from_numpy(corpus.astype(np.int64))
        self.rng = np.random.default_rng(0)

    def backward(self) -> torch.Tensor:
        starts = self.rng.integers(0, len(self.corpus) - SEQ - 1, BATCH)
        x = torch.stack([self.corpus[s : s + SEQ + 1] for s in starts])
        logits = self.model(x[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        loss.backward()
        return loss

    def counts(self) -> dict[int, torch.Tensor]:
        """torchtitan's own counters, read from its buffers."""
        return {i: m.tokens_per_expert_E.clone() for i, m in self.moes.items()}

    def step(self, loss: torch.Tensor):  # noqa: ANN201
        return self.guarded.step(loss, tokens=BATCH * SEQ)


def _state(run: Run) -> dict[str, torch.Tensor]:
    """Every weight, buffer and AdamW state tensor, copied (the per-step counters aside)."""
    s = {f"p.{k}": v.detach().clone() for k, v in run.model.named_parameters()}
    s |= {f"b.{k}": v.clone() for k, v in run.model.named_buffers() if not k.endswith("tokens_per_expert_E")}
    for i, p in enumerate(run.model.parameters()):
        for k, v in run.opt.state.get(p, {}).items():
            s[f"o.{i}.{k}"] = v.clone() if torch.is_tensor(v) else torch.tensor(v)
    return s


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def _loads(run_dir: Path) -> dict[tuple[int, int], list[int]]:
    df = read_table(run_dir, "experts").sort(["step", "layer", "expert"])
    out: dict[tuple[int, int], list[int]] = {}
    for (step, layer), g in df.group_by(["step", "layer"], maintain_order=True):
        out[(int(step), int(layer))] = g["load"].to_list()
    return out


# One run serves the clean-run claims and the collapse claim: GuardConfig's defaults, clean for
# CLEAN_STEPS steps (every detector armed: the spike rules' tail fit from 200 accepted steps, the
# collapse detector from collapse.warmup = 250), then layer COLLAPSE_LAYER's tokens forced to
# expert 0 at CLEAN_STEPS and COLLAPSE_STEPS more steps to correct it and stay corrected.
CLEAN_STEPS, COLLAPSE_STEPS, COLLAPSE_LAYER = 300, 100, 2


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory: pytest.TempPathFactory, corpus: np.ndarray, parallel_dims: object):
    run_dir = tmp_path_factory.mktemp("tt") / "clean"
    run = Run(run_dir, corpus, parallel_dims)
    seen: dict[tuple[int, int], list[int]] = {}
    for step in range(CLEAN_STEPS + COLLAPSE_STEPS):
        if step == CLEAN_STEPS:
            force_collapse(run.model, COLLAPSE_LAYER, margin=0.5)
        loss = run.backward()
        seen |= {(step, i): c.round().long().tolist() for i, c in run.counts().items()}
        run.step(loss)
    run.guarded.close()
    return run, run_dir, seen


def test_stored_loads_are_torchtitans_own_counters(clean_run) -> None:
    run, run_dir, seen = clean_run
    stored = _loads(run_dir)
    assert set(stored) == set(seen) and len(seen) == (CLEAN_STEPS + COLLAPSE_STEPS) * 3
    assert stored == seen
    # one step's tokens each (torchtitan's hook zeroes them on every applied step): top-2 of B*SEQ
    assert {sum(v) for v in seen.values()} == {2 * BATCH * SEQ}
    assert sorted(run.moes) == [1, 2, 3] and run.att.n_experts == 8 and run.att.top_k == 2


def test_clean_run_draws_no_action(clean_run) -> None:
    _, run_dir, _ = clean_run
    steps = read_table(run_dir, "steps").filter(pl.col("step") < CLEAN_STEPS)
    events = read_table(run_dir, "events").filter(pl.col("step") < CLEAN_STEPS)
    fired = events.select("step", "kind", "detector", "action", "value", "threshold", "detail").rows()
    assert steps.height == CLEAN_STEPS
    assert steps["action"].unique().to_list() == [schema.ACT_APPLY], fired
    # a collapse correction leaves the step's action at "apply": no guard event either (the host's
    # data-stall and throughput notes are informational and depend on this shared VM's load)
    host = (schema.DET_STALL, schema.DET_THROUGHPUT)
    assert events.filter(~pl.col("detector").is_in(host)).height == 0, fired


def test_spike_and_nan_are_skipped_bit_exactly(
    tmp_path: Path, corpus: np.ndarray, parallel_dims: object
) -> None:
    # clip_spikes off: the skip path, what every NaN, loss and LR spike gets (the default clips a
    # finite grad spike: test_torchtitans_own_trainer_is_guarded)
    skipping = GuardConfig(policy=PolicyConfig(clip_spikes=False))
    run = Run(tmp_path / "faults", corpus, parallel_dims, config=skipping)
    bad = {60: "spike", 70: "nan"}
    for step in range(80):
        loss = run.backward()
        if step in bad:
            with torch.no_grad():
                if bad[step] == "spike":
                    torch._foreach_mul_(
                        [p.grad for p in run.model.parameters() if p.grad is not None], 1000.0
                    )
                else:
                    next(p for p in run.model.parameters() if p.grad is not None).grad[0].fill_(float("nan"))
            before = _state(run)
            assert any(k.endswith("expert_bias_E") for k in before) and any(
                k.startswith("o.") for k in before
            )
            d = run.step(loss)
            after = _state(run)
            assert d.action == schema.ACT_SKIP, (step, bad[step], d.action)
            assert before.keys() == after.keys()
            changed = [k for k in before if not _bitwise_equal(before[k], after[k])]
            assert not changed, (bad[step], changed[:5])
            # the skipped step's counts must not leak into the next step (torchtitan's hook never ran)
            assert all(float(m.tokens_per_expert_E.abs().sum()) == 0 for m in run.moes.values())
        else:
            d = run.step(loss)
            assert d.action == schema.ACT_APPLY, (
                step,
                [(e.detector, e.value, e.threshold, e.detail) for e in d.events],
            )
    run.guarded.close()
    loads = _loads(tmp_path / "faults")
    assert {sum(loads[(s, i)]) for s in (61, 71) for i in run.moes} == {2 * BATCH * SEQ}
    actions = read_table(tmp_path / "faults", "steps").filter(pl.col("action") != schema.ACT_APPLY)
    assert actions["step"].to_list() == [60, 70]


def test_forced_collapse_is_detected_and_corrected(clean_run) -> None:
    # The collapse is forced on the clean run once it is past collapse.warmup (250, the default):
    # this model's routing is chaotic until torchtitan's balancing catches up (MaxVio near its top,
    # 3, on layers 1-3 around steps 30-90, under 1.6 from step 100 on).
    _, run_dir, _ = clean_run
    cfg = GuardConfig()
    layer, at = COLLAPSE_LAYER, CLEAN_STEPS
    events = read_table(run_dir, "events")
    detail = [json.loads(d) if d else {} for d in events["detail"].to_list()]
    events = events.with_columns(pl.Series("layer_", [d.get("layer", -1) for d in detail]))
    verdicts = events.filter(
        (pl.col("kind") == schema.EV_VERDICT) & pl.col("detector").is_in(schema.COLLAPSE_DETECTORS)
    )
    assert verdicts.height >= 1 and verdicts["step"].min() >= at, verdicts.rows()
    acts = events.filter((pl.col("kind") == schema.EV_ACTION) & (pl.col("action") == schema.ACT_BIAS_CORRECT))
    assert acts.height >= 1 and set(acts["layer_"].to_list()) == {layer}, acts.rows()
    started = int(acts["step"].min())
    maxvio = read_table(run_dir, "layers").filter(pl.col("layer") == layer).sort("step")
    before = maxvio.filter(pl.col("step").is_between(started - 5, started))["maxvio"]
    assert before.min() > cfg.collapse.maxvio, before.to_list()
    after = maxvio.filter(pl.col("step") > started)
    back = after.filter(pl.col("maxvio") < cfg.collapse.maxvio)
    assert (
        back.height
        and after.filter(pl.col("step") >= back["step"].min() + 10)["maxvio"].max() < cfg.collapse.maxvio
    )
    recovered = events.filter(pl.col("kind") == schema.EV_RECOVERED)
    assert recovered["layer_"].to_list() == [layer], events.rows()
    steps = read_table(run_dir, "steps")
    assert steps["action"].is_in(list(schema.APPLYING_ACTIONS)).all()  # corrected, no update thrown away


def test_loop_without_torchtitans_hook_still_reads_one_step_each(tmp_path: Path, corpus: np.ndarray) -> None:
    run = Run(tmp_path / "nohook", corpus, None)  # nobody but the adapter zeroes the counters here
    for _ in range(5):
        run.step(run.backward())
    run.guarded.close()
    assert {sum(v) for v in _loads(tmp_path / "nohook").values()} == {2 * BATCH * SEQ}


def test_without_load_balance_coeff_a_collapse_is_observed_not_claimed_corrected(corpus: np.ndarray) -> None:
    cfg = model_config()
    for layer in cfg.layers:
        if layer.moe is not None:
            layer.moe.load_balance_coeff = None  # no expert_bias_E: nothing to correct through
    model = build(cfg, seed=0)
    att = attach(model)
    assert att.corrector is None and att.correction_mode == "none"
    force_collapse(model, 2, margin=50.0)  # logits along the next input's mean direction
    x = torch.from_numpy(corpus[: BATCH * SEQ].astype(np.int64)).reshape(BATCH, SEQ)
    model(x)
    src = dict(att.routers)[2]
    load = src.tokens_per_expert_E
    assert float(load[0]) > 0.8 * BATCH * SEQ and float(load.max() / load.mean()) - 1 > 2.0  # MaxVio past 2
    assert float(src.expert_bias_E.abs().sum()) == 0
    att.after_step(False)
    assert all(float(s.tokens_per_expert_E.sum()) == 0 for _, s in att.routers)
    att.remove()


def test_a_model_without_moe_is_refused_by_name() -> None:
    class Dense(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleDict({"0": nn.Linear(4, 4)})

    with pytest.raises(ValueError, match="Dense: no MoE layer"):
        attach(Dense())


def _cpu_shim(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchtitan pointed at the CPU as the launcher does on a host without CUDA
    (guard/integrations/torchtitan/cpu.py), undone after the test."""
    from guard.integrations.torchtitan.cpu import use_cpu

    use_cpu(monkeypatch.setattr)
    monkeypatch.setenv("LOCAL_RANK", "0")


def _tt_config(tmp_path: Path, *, steps: int, **extra: object) -> object:
    """torchtitan's Trainer.Config for the small model on the CPU: stdlib windows, bytes, no
    checkpoint; `extra`: more Trainer.Config fields (a validator)."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import (
        LRSchedulersContainer,
        default_adamw,
        register_moe_load_balancing_hook,
    )
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.models.deepseek_v3 import parallelize_deepseekv3
    from torchtitan.protocols.model_spec import ModelSpec
    from torchtitan.trainer import Trainer

    from bench.common.torchtitan_registry import Bytes, Windows  # no hub download: bytes, stdlib windows

    optimizer = default_adamw(lr=1e-3)
    optimizer.implementation = "foreach"
    spec = ModelSpec(
        name="deepseek_v3",
        flavor="test",
        model=model_config(),
        parallelize_fn=parallelize_deepseekv3,
        pipelining_fn=None,
        post_optimizer_build_fn=register_moe_load_balancing_hook,
        state_dict_adapter=None,
    )
    return Trainer.Config(
        model_spec=spec,
        hf_assets_path=str(tmp_path),
        dump_folder=str(tmp_path / "out"),
        tokenizer=Bytes.Config(),
        dataloader=Windows.Config(),
        loss=CrossEntropyLoss.Config(global_vocab_size=VOCAB),
        optimizer=optimizer,
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=10),
        metrics=MetricsProcessor.Config(log_freq=10),
        training=TrainingConfig(
            local_batch_size=BATCH,
            seq_len=SEQ,
            steps=steps,
            disable_cuda_graphs=True,
            mixed_precision_param="float32",
            max_norm=1.0,
        ),
        parallelism=ParallelismConfig(),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=None,
        **extra,
    )


def test_torchtitans_own_trainer_is_guarded(
    tmp_path: Path, corpus: np.ndarray, parallel_dims: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default policy in torchtitan's own Trainer: a finite x1000 grad spike (guard step 45)
    is flagged and applied as the unguarded step (torchtitan's max_norm, tighter than the guard's
    clip, makes it the same update: no guard action); a NaN (guard step 30) is skipped, every
    weight, buffer and AdamW state bit for bit as before."""
    import gc

    from guard.integrations.torchtitan import GuardedTrainer

    _cpu_shim(monkeypatch)
    fed: dict[int, list[torch.Tensor]] = {}  # torchtitan step -> the gradients its optimizer stepped on
    spiked: list[torch.Tensor] = []
    held: dict[str, torch.Tensor] = {}
    compared: list[int] = []

    class Spiky(GuardedTrainer):  # type: ignore[misc, valid-type]
        def _grads(self) -> list[torch.Tensor]:
            return [_local(p.grad) for p in self.model_parts[0].parameters() if p.grad is not None]

        def _held(self) -> dict[str, torch.Tensor]:
            """Every weight, buffer and AdamW state tensor (the container's optimizers'), copied."""
            m = self.model_parts[0]
            s = {f"p.{k}": _local(v).detach().clone() for k, v in m.named_parameters()}
            s |= {f"b.{k}": _local(v).clone() for k, v in m.named_buffers() if "tokens_per_expert" not in k}
            for j, opt in enumerate(self.optimizers.optimizers):
                for i, p in enumerate(m.parameters()):
                    for k, v in opt.state.get(p, {}).items():
                        s[f"o{j}.{i}.{k}"] = _local(v).clone() if torch.is_tensor(v) else torch.tensor(v)
            assert any(k.endswith("expert_bias_E") for k in s) and any(k.startswith("o") for k in s)
            return s

        def forward_backward_step(self, **kwargs: object) -> torch.Tensor:
            if self.step == 32:  # after the skipped step 31, before anything else moves
                now = self._held()
                assert now.keys() == held.keys()
                assert not [k for k in held if not _bitwise_equal(held[k], now[k])]
                compared.append(self.step)
            loss = super().forward_backward_step(**kwargs)
            if self.step == 31:  # torchtitan counts steps from 1: the guard's step 30
                next(iter(self._grads()))[0].fill_(float("nan"))
                held.update(self._held())
            if self.step == 46:  # the guard's step 45
                torch._foreach_mul_(self._grads(), 1000.0)
                spiked.extend(g.clone() for g in self._grads())
            return loss

    config = _tt_config(tmp_path, steps=60)
    torch.manual_seed(0)
    trainer = Spiky(config, run_dir=tmp_path / "run")
    trainer.optimizers.register_step_pre_hook(  # the container's own hooks: applied steps only
        lambda *_: fed.__setitem__(trainer.step, [g.clone() for g in trainer._grads()])
    )
    try:
        trainer.train()
    finally:
        trainer.close()
        gc.enable()  # torchtitan's Trainer takes the garbage collector over
    steps = read_table(tmp_path / "run", "steps").sort("step")
    assert steps.height == 60
    assert steps.filter(pl.col("action") != schema.ACT_APPLY)["step"].to_list() == [30]
    assert steps["action"][30] == schema.ACT_SKIP and compared == [32]  # bitwise, at the next step
    assert 31 not in fed and len(fed) == 59  # the skip never reached torchtitan's optimizer
    assert steps["grad_norm"][45] > 100 and config.training.max_norm == float(
        "inf"
    )  # the guard saw it unclipped
    # the spike's verdicts are recorded; the guard took no action on them: clipped to the
    # guard's threshold it would still be over torchtitan's max_norm (1.0, now the guard's grad_clip)
    ev = read_table(tmp_path / "run", "events").filter(
        (pl.col("step") == 45) & (pl.col("kind") == schema.EV_VERDICT)
    )
    assert set(ev["detector"]) <= {schema.DET_GRAD_SPIKE, schema.DET_LAYER_GRAD_SPIKE} and ev.height
    assert set(ev["action"]) == {schema.ACT_NONE}
    assert {json.loads(d)["within_grad_clip"] for d in ev["detail"]} == {1.0}
    # the update applied is the unguarded one: the spiked gradient clipped to max_norm as
    # torch.nn.utils.clip_grad_norm_ (torchtitan's clip) scales it
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in spiked]))
    assert float(norm) == pytest.approx(steps["grad_norm"][45], rel=1e-5)
    coef = 1.0 / (norm + 1e-6)
    assert all(torch.allclose(g, s * coef, rtol=1e-5, atol=0) for g, s in zip(fed[46], spiked, strict=True))
    loads, experts = _loads(tmp_path / "run"), read_table(tmp_path / "run", "experts")
    assert {sum(v) for v in loads.values()} == {2 * BATCH * SEQ} and len(loads) == 60 * 3
    bias = {s: g.sort(["layer", "expert"])["bias"].to_list() for (s,), g in experts.group_by(["step"])}
    moved = [s for s in range(59) if bias[s] != bias[s + 1]]  # torchtitan's own update, applied steps only
    assert moved == [s for s in range(59) if s != 30]


def test_torchtitans_validation_loss_lands_in_evals(
    tmp_path: Path, parallel_dims: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchtitan's own validator (issue #40): its loss, as it logs it, is the run's eval_loss at
    the guard's step (torchtitan step S is the guard's S - 1)."""
    import gc

    from torchtitan.components.validate import Validator

    from bench.common.torchtitan_registry import Windows
    from guard.integrations.torchtitan import GuardedTrainer

    _cpu_shim(monkeypatch)
    val = Validator.Config(enable=True, freq=2, steps=2, dataloader=Windows.Config(seed=1))
    config = _tt_config(tmp_path, steps=4, validator=val)
    torch.manual_seed(0)
    trainer = GuardedTrainer(config, run_dir=tmp_path / "run")
    logged: list[tuple[int, float]] = []
    log = trainer._log_validation  # torchtitan's own, which the guard's hook calls on
    trainer._log_validation = lambda loss, step, extra_metrics=None: (
        logged.append((step, loss)) or log(loss=loss, step=step, extra_metrics=extra_metrics)
    )
    try:
        trainer.train()
    finally:
        trainer.close()
        gc.enable()
    assert [s for s, _ in logged] == [1, 2, 4]  # torchtitan validates at step 1 and every `freq`
    evals = read_table(tmp_path / "run", "evals").sort("step")
    assert evals["name"].unique().to_list() == ["eval_loss"]
    assert evals["step"].to_list() == [0, 1, 3]
    assert evals["value"].to_list() == pytest.approx([v for _, v in logged], rel=1e-6)
    assert read_table(tmp_path / "run", "steps").height == 4


def test_the_registrys_jobs_validate_on_stdlib_windows() -> None:
    """`--validator.enable` on the README's tiny recipe: torchtitan's default validation set is
    c4 from the hub (a ConnectionError here); the registry's jobs give it windows of another seed
    and a fixed number of batches (the stream never ends). Checked by hand through torchrun with
    --validator.enable --validator.freq 3: eval_loss at the guard's steps 0, 2, 5."""
    from torchtitan.components.validate import Validator

    from bench.common.torchtitan_registry import Windows, debugmodel_cpu, tiny_moe

    for job in (tiny_moe(), debugmodel_cpu()):
        val = job.validator
        assert isinstance(val, Validator.Config) and not val.enable  # off unless asked for
        assert isinstance(val.dataloader, Windows.Config) and val.dataloader.seed != job.dataloader.seed
        assert val.steps > 0
