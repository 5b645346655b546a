"""`moeguard canary --matrix`: the kernel-choice matrix, variants interleaved (A B C A B C ...) so
the host's drift hits all alike. No gate: a table of MFU per variant, and what each one actually ran.

    moeguard canary --matrix attention=math,flash,efficient experts=loop,bmm,grouped_mm compile=off,on
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from pathlib import Path
from typing import Any

from guard.canary.config import EXIT_FAIL, EXIT_PASS, TIMING_CPU, Setup, parse_slow
from guard.canary.history import finite
from guard.canary.keys import LOSS, MFU, TPS
from guard.canary.measure import Measurement, describe, measure, progress
from guard.canary.report import write_json_and_markdown
from guard.core.tomlconf import ConfigError

MATRIX_AXES = {"attention": "model.attention", "experts": "model.experts_kernel", "compile": "train.compile"}
_BOOL_WORDS = {"on": True, "off": False, "true": True, "false": False, "1": True, "0": False}


def parse_matrix(tokens: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """['attention=math,flash', 'compile=off,on'] -> [(label, overrides)] (the cartesian product).

    Axes: attention, experts, compile, or any dotted config key (e.g. model.top_k=1,2)."""
    axes: list[tuple[str, str, list[tuple[str, Any]]]] = []
    for tok in tokens:
        name, sep, vals = tok.partition("=")
        if not sep or not name or not vals:
            raise ConfigError(
                f"--matrix {tok!r}: expected AXIS=V1,V2 (axes: {', '.join(MATRIX_AXES)} or a dotted key)"
            )
        key = MATRIX_AXES.get(name, name)
        if "." not in key:
            raise ConfigError(
                f"--matrix {tok!r}: unknown axis {name!r}; axes: {', '.join(MATRIX_AXES)} or a dotted key"
            )
        values = []
        for raw in (v.strip() for v in vals.split(",") if v.strip()):
            values.append((raw, _matrix_value(key, raw)))
        axes.append((name, key, values))
    variants = []
    for combo in itertools.product(*(vals for _, _, vals in axes)):
        label = " ".join(f"{name}={raw}" for (name, _, _), (raw, _) in zip(axes, combo, strict=True))
        variants.append((label, {key: v for (_, key, _), (_, v) in zip(axes, combo, strict=True)}))
    return variants


def _matrix_value(key: str, raw: str) -> Any:
    if key == "train.compile" or raw.lower() in ("on", "off"):
        if raw.lower() not in _BOOL_WORDS:
            raise ConfigError(f"--matrix {key}={raw!r}: expected on|off")
        return _BOOL_WORDS[raw.lower()]
    for conv in (int, float):
        try:
            return conv(raw)
        except ValueError:
            pass
    return raw


def run_matrix(args: argparse.Namespace, setup: Setup) -> int:
    variants = parse_matrix(args.matrix)
    for _, ov in variants:  # validate every variant's config before spending minutes measuring
        setup.train_config(ov)
    repeats = max(1, args.repeats)
    slow = parse_slow(args.inject)
    results: dict[str, list[Measurement]] = {label: [] for label, _ in variants}
    unavailable: dict[str, str] = {}
    n_total = len(variants) * repeats
    k = 0
    for r in range(1, repeats + 1):
        for label, ov in variants:
            k += 1
            if label in unavailable:
                continue
            progress(f"[{k}/{n_total}] {label} (repeat {r}) ...")
            m = measure(
                setup,
                Path(args.runs),
                name=f"canary[{label}]",
                variant=ov,
                variant_label=label,
                slow_pct=slow,
                attempt=r,
            )
            results[label].append(m)
            if m.result.get("status") == "unavailable":
                unavailable[label] = m.result.get("reason", "")
                progress(f"    unavailable: {unavailable[label]}")
            elif m.ok:
                progress(f"    {describe(m)}")
            else:
                progress(f"    error: {m.result.get('reason')}")
    rep = matrix_report(setup, variants, results, repeats)
    md, _ = write_json_and_markdown(rep, Path(args.report_dir), "matrix", render_matrix_markdown)
    print(render_matrix_table(rep))
    print(f"report: {md}")
    return EXIT_FAIL if any(v["status"] == "error" for v in rep["variants"]) else EXIT_PASS


def matrix_report(
    setup: Setup,
    variants: list[tuple[str, dict[str, Any]]],
    results: dict[str, list[Measurement]],
    repeats: int,
) -> dict[str, Any]:
    rows = []
    for label, ov in variants:
        ms = results[label]
        ok = [m for m in ms if m.ok]
        row: dict[str, Any] = {
            "variant": label,
            "overrides": ov,
            "runs": [m.result.get("run_id") for m in ok],
        }
        if ms and ms[0].result.get("status") == "unavailable":
            row.update(status="unavailable", reason=ms[0].result.get("reason", ""))
        elif not ok:
            row.update(status="error", reason="; ".join(str(m.result.get("reason")) for m in ms))
        else:
            mfus = [m.summary[MFU] for m in ok]
            med = statistics.median(mfus)
            row.update(
                status="ok" if len(ok) == len(ms) else "partial",
                reason="" if len(ok) == len(ms) else f"{len(ms) - len(ok)} repeat(s) failed",
                timing=ok[0].result.get("timing"),
                mfu_p50=med,
                mfu_spread_pct=100 * (max(mfus) - min(mfus)) / med if med else None,
                mfu_repeats=mfus,
                tokens_per_s_p50=statistics.median(m.summary[TPS] for m in ok),
                mfu_wall_p50=statistics.median(m.summary["mfu_wall_p50"] for m in ok),
                tokens_per_s_wall_p50=statistics.median(m.summary["tokens_per_s_wall_p50"] for m in ok),
                first_step_s=statistics.median(m.summary["first_step_s"] for m in ok),
                compile_s=statistics.median(m.summary["compile_s"] for m in ok),
                final_loss=statistics.median(m.summary[LOSS] for m in ok),
                attention_backend=ok[0].result["env"].get("attention_backend"),
                expert_kernel=ok[0].result["env"].get("expert_kernel"),
                loadavg=[m.result.get("loadavg") for m in ok],
            )
        rows.append(row)
    return finite(
        {
            "config": str(setup.path),
            "config_label": setup.label(),
            "repeats": repeats,
            "order": "interleaved: every variant once per repeat, in the same order",
            "variants": rows,
        }
    )


def render_matrix_table(rep: dict[str, Any]) -> str:
    ok = sorted((v for v in rep["variants"] if v.get("mfu_p50") is not None), key=lambda v: -v["mfu_p50"])
    rest = [v for v in rep["variants"] if v.get("mfu_p50") is None]
    timing = ok[0].get("timing") if ok else None
    tps = "tokens/CPU-s p50" if timing == TIMING_CPU else "tokens/s p50"
    lines = [
        f"| variant | MFU p50 | spread | {tps} | wall MFU p50 | wall tokens/s | first step s | loss | status |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for v in ok:
        lines.append(
            f"| {v['variant']} | {100 * v['mfu_p50']:.3f}% | {v['mfu_spread_pct'] or 0:.1f}% | "
            f"{v['tokens_per_s_p50']:,.0f} | {100 * (v['mfu_wall_p50'] or 0):.3f}% | "
            f"{v['tokens_per_s_wall_p50'] or 0:,.0f} | {v['first_step_s'] or 0:.2f} | "
            f"{v['final_loss'] or 0:.4f} | {v['status']} |"
        )
    for v in rest:
        lines.append(
            f"| {v['variant']} | — | — | — | — | — | — | — | {v['status']}: {v.get('reason', '')[:120]} |"
        )
    return "\n".join(lines)


def render_matrix_markdown(rep: dict[str, Any]) -> str:
    return "\n".join(
        [
            "# Canary kernel matrix",
            "",
            f"- config: `{rep['config_label']}`; {rep['repeats']} repeat(s), {rep['order']}",
            "- MFU p50: median over repeats of each run's steady-state p50 (CPU: against the paired reference); "
            "spread: (max - min) / median over repeats; first step includes torch.compile time when compile=on.",
            "",
            render_matrix_table(rep),
            "",
        ]
    )
