"""Part `hf_trainer`: the transformers Trainer, plain vs with MoEGuardCallback streaming to a
collector on loopback, on a Mixtral-shaped model: the overhead, and host syncs a step.

bench/overhead/trainer_overhead.py's method and its `Driven` (each Trainer in its own thread, held
at `on_step_begin` until the measuring thread lets one optimizer step through;
bench/overhead/integration_overhead.py's `interleave` and `summary`), on the device: with `cuda`
the gate synchronizes the device before it reports a step done, so a step's time is its whole work
in both variants. Blocks of STEPS_PER_BLOCK steps alternate A B /
B A while the time box allows. Host syncs: SYNC_STEPS steps of each variant (after the warm-up,
before the timed blocks) run under set_sync_debug_mode; their per-step median, plain vs guarded.

  gpu: Mixtral-shaped, hidden 1024, 8 layers, 16 heads (4 KV), 8 experts of 2816 top-2, vocab
       32000 (byte ids), ~0.64 B parameters, bf16 autocast (TrainingArguments.bf16), SDPA,
       batch 4 x 2048
  dry: the same config class at hidden 64, 2 layers, 4 experts, CPU, fp32, batch 2 x 64

Writes docs/BENCHMARKS.md › GPU, through `bench/gpu/report.py`: no section of its own.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.gpu.common import SKIPPED_CUDA, TARGET_OVERHEAD, PartLog
from bench.gpu.tt_main import count_syncs

# (hidden, layers, heads, kv heads, expert hidden, experts, top-k, vocab, batch, seq)
SIZES = {"gpu": (1024, 8, 16, 4, 2816, 8, 2, 32000, 4, 2048), "dry": (64, 2, 4, 2, 128, 4, 2, 256, 2, 64)}
WARMUP, SYNC_STEPS, STEPS_PER_BLOCK = 5, 4, 10
MAX_ROUNDS = {"gpu": 20, "dry": 1}  # rounds at most, each A B then B A (dry: 2 pairs, an interval)
LR, CLIP = 3e-4, 1.0


def mixtral(size: str, seed: int = 0) -> torch.nn.Module:
    import transformers as tf

    hidden, layers, heads, kv, ffn, experts, k, vocab, _, seq = SIZES[size]
    cfg = tf.MixtralConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=ffn,
        num_local_experts=experts,
        num_experts_per_tok=k,
        max_position_embeddings=max(seq, 512),
        tie_word_embeddings=False,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
    )
    cfg._attn_implementation = "sdpa"
    cfg.eos_token_id = cfg.bos_token_id = cfg.pad_token_id = None
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(cfg)


def run(log: PartLog, *, dry: bool, deadline: float) -> None:
    from bench.overhead.integration_overhead import interleave, run_block, summary
    from bench.overhead.torchtitan_launch_overhead import TOKEN, start_collector
    from bench.overhead.trainer_overhead import Driven
    from trainer.data import stdlib_corpus

    size = "dry" if dry else "gpu"
    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(1)
    os.environ["MOEGUARD_TOKEN"] = TOKEN
    corpus = stdlib_corpus(4_000_000)
    steps = WARMUP + SYNC_STEPS + 2 * MAX_ROUNDS[size] * STEPS_PER_BLOCK + 20
    log.put("setup", {"size": size, "shape": SIZES[size], "steps_per_block": STEPS_PER_BLOCK, "bf16": cuda})
    with tempfile.TemporaryDirectory(prefix="moeguard-gpu-hf-") as d:
        tmp = Path(d)
        collector, url = start_collector(tmp)
        a = b = None
        try:
            batch, seq = SIZES[size][-2:]
            kw: dict[str, Any] = dict(seed=0, corpus=corpus, batch=batch, seq=seq, steps=steps, tmp=tmp)
            a = Driven(mixtral(size), guarded=False, cuda=cuda, **kw)
            b = Driven(mixtral(size), guarded=True, cuda=cuda, collector=url, **kw)
            log.put("params", sum(p.numel() for p in a.model.parameters()))
            run_block(a, WARMUP)
            run_block(b, WARMUP)
            per_a = [count_syncs(lambda: a.step(None))[1] for _ in range(SYNC_STEPS)]
            per_b = [count_syncs(lambda: b.step(None))[1] for _ in range(SYNC_STEPS)]
            if cuda:
                log.put(
                    "syncs",
                    {
                        "plain_per_step": statistics.median(per_a),
                        "guarded_per_step": statistics.median(per_b),
                        "guard_extra_per_step": statistics.median(per_b) - statistics.median(per_a),
                        "plain_all": per_a,
                        "guarded_all": per_b,
                        "target_extra": 1,
                    },
                )
            else:
                log.put(
                    "syncs",
                    f"{SKIPPED_CUDA} (torch.cuda.set_sync_debug_mode); the counter ran on "
                    f"{len(per_a)} + {len(per_b)} steps",
                )
            m: dict[str, list[float]] = {}
            t_round = 0.0  # one round: two pairs of blocks (A B, B A)
            for i in range(MAX_ROUNDS[size]):
                if i > 0 and deadline - time.monotonic() < 1.2 * t_round + 5:
                    break
                t0 = time.monotonic()
                got = interleave(a, b, blocks=2, steps_per_block=STEPS_PER_BLOCK)
                t_round = time.monotonic() - t0
                for k, v in got.items():
                    m.setdefault(k, []).extend(v)
                assert b.guard is not None and b.guard.guarded is not None
                res = summary(m, a.model, b.guard.guarded, seed=0)
                lo, hi = res["overhead_ci95"]
                res.update(target=TARGET_OVERHEAD, met=(hi <= TARGET_OVERHEAD) if cuda else None)
                log.put("overhead", res)
            if not m:
                log.not_done("overhead", "time box: no block pair fitted after the warm-up")
        finally:
            for v in (a, b):
                if v is not None:
                    v.close(check=False)  # the block that failed has raised already
            collector.terminate()
            collector.wait(30)
