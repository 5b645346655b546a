"""Every sparse-MoE causal-LM family of transformers 5.23 attaches or is refused at attach (issue #28).

Per family, on every commit (tiny random-init models, CPU): attach() succeeds, its dry forwards
leaving weights, buffers and the RNG state as they were, or refuses naming the class; an attached
model trains a step without error, and the loads the guard stored are the ones the model used,
read independently of the guard's hook by bench/drills/family_matrix.py's `independent_loads` (the ids
each experts module was handed; for Llama4, whose experts get none, and JetMoE, whose gating sorts
them, the top-k of the router's own logits, the selection both models make; for zaya, ZayaRouter's
own rule). The long drills (spikes, clean runs, collapse) run for a subset in
test_integration_transformers.py and for every family in bench/drills/family_matrix.py.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from bench.drills.family_matrix import independent_loads  # noqa: E402
from guard.integrations.base import BiasCorrector  # noqa: E402
from guard.integrations.tiny import ALL_FAMILIES, build  # noqa: E402
from guard.integrations.transformers import attach  # noqa: E402

# Families with no router of the shape a sparse MoE block has (Doge's cross-domain MoE routes
# through product keys into embedding experts): refused at attach, the class named.
REFUSED = {"doge": "DogeForCausalLM"}
# Where each family keeps a selection bias that moves its top-k (proved by attach's dry forward)
BIAS_AT = {
    "afmoe": "expert_bias",  # on the MoE block, handed to the sigmoid router
    "ernie4_5_moe": "e_score_correction_bias",  # in router.moe_statics
    "deepseek_v3": "e_score_correction_bias",
    "glm4_moe": "e_score_correction_bias",
    "dots1": "e_score_correction_bias",
    "longcat_flash": "e_score_correction_bias",
    "bailing_hybrid": "e_score_correction_bias",
    "lfm2_moe": "expert_bias",
    "zaya": "balancing_biases",
}


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_every_family_attaches_or_is_refused_and_loads_are_the_models(family: str) -> None:
    torch.set_num_threads(1)
    model = build(family, seed=0)
    if family in REFUSED:
        with pytest.raises(ValueError, match=f"^{REFUSED[family]}: "):
            attach(model)
        return
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        att = attach(model)
    assert torch.equal(torch.get_rng_state(), rng), "attach's dry forwards moved the RNG"
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "attach changed the model"
    assert att.routers, family
    if family in BIAS_AT:
        assert isinstance(att.corrector, BiasCorrector), (family, att.correction_mode)
        hook = att.routers[0][1]
        assert hook.has_selection_bias
    seen, handles = independent_loads(model, att)  # bench/drills/family_matrix.py's observer
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    out = model(input_ids=x, labels=x)
    out.loss.backward()
    for h in handles:
        h.remove()
    for layer, hook in att.routers:
        r = hook.reading
        stored = hook.tokens_per_expert_E
        assert float(stored.sum()) == 64 * r.top_k, (family, layer)
        assert torch.equal(stored.long(), seen[-1][layer].long()), (family, layer, stored, seen[-1][layer])
    att.remove()


def test_afmoe_reads_its_sigmoid_router_and_the_bias_its_block_holds() -> None:
    model = build("afmoe", seed=0)
    att = attach(model, bias_update="smebu")
    hook = att.routers[0][1]
    block = next(m for m in model.modules() if hasattr(m, "expert_bias"))
    assert hook.score_func == "sigmoid"
    assert hook.expert_bias_E.data_ptr() == block.expert_bias.data_ptr()
    assert att.corrector.update == "smebu"


def test_ernie_reads_the_bias_in_moe_statics() -> None:
    model = build("ernie4_5_moe", seed=0)
    att = attach(model)
    hook = att.routers[0][1]
    statics = next(m for m in model.modules() if type(m).__name__.endswith("MoeStatics"))
    assert hook.expert_bias_E.data_ptr() == statics.e_score_correction_bias.data_ptr()
    assert hook.score_func == "softmax"


def test_zaya_skip_expert_is_counted_on_its_own_bin_not_on_expert_0() -> None:
    """ZayaRouter hands a skip-expert selection on as (expert 0, weight 0); read from the ids
    alone it lands on expert 0 and the skip bin reads empty whatever the router does."""
    model = build("zaya", seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        att = attach(model)
    assert all(h.reading.null_as == 0 for _, h in att.routers)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "balancing_biases"):
                m.balancing_biases[-1] = 5.0  # every token to the skip expert
        model(input_ids=torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0)))
    for layer, hook in att.routers:
        load = hook.tokens_per_expert_E
        assert float(load[-1]) == 32 and float(load[:-1].sum()) == 0, (layer, load)


def test_zero_computation_experts_that_keep_their_ids_are_not_rewritten() -> None:
    model = build("longcat_flash", seed=0)  # 8 experts + 2 identities, ids 8 and 9 as they are
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        att = attach(model)
    assert all(h.reading.null_as is None for _, h in att.routers)


class _LogitsOnly(nn.Module):
    """A router that returns logits and a block that never hands its experts any ids."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, 8) @ self.weight.T


class _Experts(nn.Module):
    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return x * weights.softmax(-1).max(-1, keepdim=True).values.reshape(*x.shape[:-1], 1)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.experts = _LogitsOnly(), _Experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(vocab_size=16)  # where the dry forward reads the vocabulary
        self.emb = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([_Block(), _Block()])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(input_ids)
        for blk in self.layers:
            h = blk(h)
        return h


def test_a_router_it_cannot_read_is_refused_at_attach_naming_class_and_what_was_missing() -> None:
    with pytest.raises(ValueError) as e:
        attach(_Model())
    msg = str(e.value)
    assert msg.startswith("_Model: layer 0 router gate (_LogitsOnly): ")
    assert "no top-k indices, per-expert counts or selection mask" in msg


def test_bias_updates_sign_and_smebu_move_the_bias_towards_balance() -> None:
    from guard.integrations.base import smebu_step

    load = torch.tensor([10.0, 2.0, 2.0, 2.0])
    m = torch.zeros(4)
    step = smebu_step(load, m)  # lam 5e-4, kappa 2, beta 0.5, mean-centred
    assert step[0] < 0 < step[1] and abs(float(step.sum())) < 1e-9
    mean = load.mean()
    d = 5e-4 * torch.tanh(2 * (mean - load) / mean)
    assert torch.allclose(step, 0.5 * (d - d.mean()))
    again = smebu_step(load, m)  # momentum: 0.5 * m + 0.5 * d
    assert torch.allclose(again, 0.75 * (d - d.mean()))
    b = torch.zeros(4)
    c = BiasCorrector(biases={0: lambda: b}, order=[0], update="sign")
    c.correct({}, load.unsqueeze(0), applied=True)
    assert torch.allclose(b, torch.tensor([-1.5e-3, 0.5e-3, 0.5e-3, 0.5e-3]))
    c.correct({}, load.unsqueeze(0), applied=False)  # a skipped step moves no bias
    assert torch.allclose(b, torch.tensor([-1.5e-3, 0.5e-3, 0.5e-3, 0.5e-3]))
    with pytest.raises(ValueError, match="bias_update = 'adam'"):
        BiasCorrector(biases={}, update="adam")


# Config keys that hold a sparse MoE's expert count (on the config, its text_config, or DBRX's
# ffn_config); a model type whose defaults set one is a sparse-MoE family.
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "n_experts")


def _experts_in(cfg: object) -> bool:
    return any(getattr(c, k, None) for c in (cfg, getattr(cfg, "ffn_config", None)) for k in _EXPERT_KEYS)


def test_all_families_is_every_sparse_moe_causal_lm_of_the_installed_transformers() -> None:
    """tiny.py's list is checked against transformers itself: every causal-LM model type whose
    default config has experts is in ALL_FAMILIES, directly or through its text model (llama4 ->
    llama4_text); a new transformers that adds a family fails here, naming it."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    missing = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            try:
                cfg = CONFIG_MAPPING[model_type]()
            except Exception:  # noqa: BLE001 - a config that cannot build from defaults is no tiny family
                continue
            text = getattr(cfg, "text_config", None)
            if not (_experts_in(cfg) or (text is not None and _experts_in(text))):
                continue
            if model_type not in ALL_FAMILIES and getattr(text, "model_type", None) not in ALL_FAMILIES:
                missing.append(model_type)
    assert missing == [], f"sparse-MoE causal-LM families missing from guard/integrations/tiny.py: {missing}"
