"""playbooks/: one per alert, same sections, and every command in them works.

An on-call copies these at 3am, so: Python blocks run against a synthetic run store with the
real schema, PromQL blocks parse in a real Prometheus and use schema metric names, `moeguard`
commands and their flags exist, and `--set KEY=VALUE` overrides are valid config keys.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from guard.core import schema
from guard.resources import resource
from tests.alerts.conftest import PrometheusAPI
from tests.alerts.promql import known_metric, metric_names

REPO = Path(__file__).resolve().parents[2]
PLAYBOOKS = resource("playbooks")  # the checkout's, or the installed wheel's
SECTIONS = (
    "## What it means",
    "## Confirm",
    "## What the guard already did",
    "## What to do",
    "## Escalate when",
)
PROMQL_BUILTINS = {"ALERTS", "ALERTS_FOR_STATE", "up"}


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.M | re.S)


def playbook(alert: str) -> str:
    return (PLAYBOOKS / f"{alert}.md").read_text()


def test_one_playbook_per_alert_and_no_strays() -> None:
    files = {p.stem for p in PLAYBOOKS.glob("*.md")} - {"README"}
    assert files == set(schema.ALERTS)


@pytest.mark.parametrize("alert", schema.ALERTS)
def test_playbook_structure(alert: str) -> None:
    text = playbook(alert)
    assert text.startswith(f"# {alert}\n")
    assert "**Severity:**" in text.split("\n## ")[0]
    pos = [text.find(s) for s in SECTIONS]
    assert all(p >= 0 for p in pos), [s for s, p in zip(SECTIONS, pos, strict=True) if p < 0]
    assert pos == sorted(pos), "sections out of order"
    assert blocks(text, "promql"), "a playbook says how to confirm in Prometheus"
    if alert != "Watchdog":
        assert blocks(text, "python"), "a playbook shows the run store evidence"
    for link in re.findall(r"\]\(([A-Za-z]+\.md)\)", text):
        assert (PLAYBOOKS / link).is_file(), link


# ---------------------------------------------------------------------------------------
# Python blocks against a synthetic run store
# ---------------------------------------------------------------------------------------
def write_table(run: Path, table: str, rows: dict[str, list]) -> None:
    dtypes = {c: getattr(pl, t)() for c, t in schema.TABLE_COLUMNS[table].items()}
    n = len(next(iter(rows.values())))
    rows = {c: rows[c] if c in rows else [None] * n for c in dtypes}  # newer columns (precursors): empty
    df = pl.DataFrame(rows, schema=dtypes)
    (run / table).mkdir(parents=True, exist_ok=True)
    df.write_parquet(run / table / "part-0000000000-000000.parquet")


@pytest.fixture(scope="module")
def run_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """300 steps, 4 MoE layers x 8 experts, 8 ranks, with every incident the playbooks look for:
    grad/loss spikes, an LR-spike drill, two NaN steps, stalls, layer 3 collapsing, rollbacks,
    a halt, a straggler, a suspected hardware fault on rank 3."""
    run = tmp_path_factory.mktemp("runs") / "r1"
    rng = np.random.default_rng(0)
    n, n_layers, n_exp = 300, 4, 8
    steps = np.arange(n)
    loss = 3.0 - steps / 300 + rng.normal(0, 0.01, n)
    grad = 1.0 + rng.normal(0, 0.05, n)
    grad[100], loss[120] = 25.0, 9.0
    loss[150], grad[151] = math.nan, math.inf
    wait = np.full(n, 0.01)
    wait[[200, 210, 220]] = 8.0
    mfu = np.where(steps < 250, 0.40, 0.33)
    action = ["apply"] * n
    for s in (100, 120, 130, 150, 151):
        action[s] = "skip"
    write_table(
        run,
        schema.TABLE_STEPS,
        {
            "step": steps,
            "time": 1.7e9 + steps * 0.5,
            "loss": loss,
            "grad_norm": grad,
            "lr": np.full(n, 3e-4),
            "tokens": np.full(n, 4096),
            "step_time_s": 0.5 + wait,
            "data_wait_s": wait,
            "tokens_per_s": 4096 / (0.5 + wait),
            "mfu": mfu,
            "mem_peak_bytes": np.full(n, 8 << 30),
            "action": action,
        },
    )
    ls, ll = np.repeat(steps, n_layers), np.tile(np.arange(n_layers), n)
    load_entropy = np.where((ll == 3) & (ls >= 200), 0.3, 0.95)
    lgrad = np.ones(n * n_layers)
    lgrad[(ls == 150) & (ll == 2)] = math.nan
    write_table(
        run,
        schema.TABLE_LAYERS,
        {
            "step": ls,
            "layer": ll,
            "grad_norm": lgrad,
            "router_entropy": np.where(load_entropy < 0.5, 0.4, 1.8),
            "load_entropy": load_entropy,
            "maxvio": np.where(load_entropy < 0.5, 5.0, 0.2),
            "dead_experts": np.where(load_entropy < 0.5, 3, 0),
            "bias_norm": 0.01 + ls * 1e-4,
            # sampled every 10th step; layer 1's grows from step 240
            "max_logit": np.where(
                ls % 10 == 0, np.where((ll == 1) & (ls >= 240), 8.0 * 1.1 ** (ls - 240), 8.0), np.nan
            ),
        },
    )
    es = np.repeat(steps, n_layers * n_exp)
    el = np.tile(np.repeat(np.arange(n_layers), n_exp), n)
    ee = np.tile(np.arange(n_exp), n * n_layers)
    load = np.where((el == 3) & (es >= 200), np.where(ee < 2, 2000, 0), 512)
    write_table(
        run,
        schema.TABLE_EXPERTS,
        {"step": es, "layer": el, "expert": ee, "load": load, "bias": rng.normal(0, 0.01, es.size)},
    )
    ev = [
        (100, "verdict", "grad_norm_spike", 25.0, 2.0, "skip", {"z": 40.0}),
        (110, "verdict", "layer_grad_norm_spike", 9.0, 3.0, "skip", {"layer": 2}),
        (120, "verdict", "loss_spike", 9.0, 3.8, "skip", {}),
        (130, "inject", "", math.nan, math.nan, "none", {"injection": "lrspike@130:100"}),
        (
            130,
            "verdict",
            "lr_spike",
            0.03,
            3.003e-4,
            "skip",
            {"max_lr": 3e-4, "ratio": 100.0, "severity": "critical"},
        ),
        (150, "verdict", "nonfinite", math.nan, math.nan, "skip", {}),
        (151, "verdict", "nonfinite", math.inf, math.nan, "rollback", {}),
        (
            151,
            "action",
            "",
            1.0,
            3.0,
            "rollback",
            {"reason": "3 skips within 50 steps", "snapshot_before": 100, "skip_batches": 20},
        ),
        (151, "action", "", 0.5, math.nan, "lr_cooldown", {"steps": 50}),
        (200, "verdict", "data_stall", 8.0, 5.0, "none", {}),
        (205, "verdict", "load_entropy", 0.3, 0.5, "bias_correct", {"layer": 3}),
        (205, "action", "load_entropy", 0.3, 0.5, "bias_correct", {"layer": 3, "until": 255}),
        (210, "verdict", "data_stall", 8.0, 5.0, "none", {}),
        (220, "verdict", "data_stall", 8.0, 5.0, "none", {}),
        (
            255,
            "action",
            "",
            2.0,
            3.0,
            "rollback",
            {
                "reason": "layer 3 did not recover from load_entropy",
                "snapshot_before": 200,
                "skip_batches": 20,
            },
        ),
        (
            175,
            "rerun",
            "suspected_hardware_fault",
            math.inf,
            0.01,
            "apply",
            {"rank": 3, "ranks": [3], "first": {"grad_norm": math.nan}, "recompute": {"grad_norm": 1.0}},
        ),
        (260, "straggler", "", 0.6, 0.75, "none", {"rank": 5}),
        (
            250,
            "verdict",
            "max_logit_growth",
            20.7,
            16.0,
            "none",
            {"layer": 1, "layers": [1], "precursor": True},
        ),
        (
            290,
            "halt",
            "",
            4.0,
            3.0,
            "halt",
            {"severity": "critical", "reason": "4 rollbacks within 500 steps", "rollbacks": [151, 255, 270]},
        ),
    ]
    write_table(
        run,
        schema.TABLE_EVENTS,
        {
            "step": [e[0] for e in ev],
            "time": [1.7e9 + e[0] * 0.5 for e in ev],
            "kind": [e[1] for e in ev],
            "detector": [e[2] for e in ev],
            "value": [e[3] for e in ev],
            "threshold": [e[4] for e in ev],
            "action": [e[5] for e in ev],
            "detail": [json.dumps(e[6]) for e in ev],
        },
    )
    rs, rr = np.repeat(np.arange(0, n, 20), 8), np.tile(np.arange(8), n // 20)
    st = np.where(rr == 5, 0.8, 0.5)
    write_table(
        run,
        schema.TABLE_RANKS,
        {
            "step": rs,
            "rank": rr,
            "step_time_s": st,
            "data_wait_s": np.full(rs.size, 0.01),
            "straggler_score": 0.5 / st,
            "tokens": np.full(rs.size, 512),
        },
    )
    (run / schema.META_FILE).write_text(json.dumps({"run_id": "r1", "status": "halted", "config": {}}))
    return run


@pytest.mark.parametrize("alert", [a for a in schema.ALERTS if a != "Watchdog"])
def test_playbook_python_runs_against_a_run_store(alert: str, run_store: Path) -> None:
    for i, code in enumerate(blocks(playbook(alert), "python")):
        assert '"runs/<run_id>"' in code, 'python blocks start from run = "runs/<run_id>"'
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(
                compile(code.replace('"runs/<run_id>"', repr(str(run_store))), f"{alert}.md[{i}]", "exec"), {}
            )
        assert out.getvalue().strip(), "the snippet should print its evidence"


# ---------------------------------------------------------------------------------------
# PromQL blocks parse and use schema metrics
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("alert", schema.ALERTS)
def test_playbook_promql_parses_and_uses_schema_metrics(alert: str, prometheus: PrometheusAPI) -> None:
    queries = [q for b in blocks(playbook(alert), "promql") for q in b.splitlines() if q.strip()]
    assert queries
    for q in queries:
        status, body = prometheus.query(q)
        assert status == 200 and body["status"] == "success", (q, body)
        unknown = {m for m in metric_names(q) if not known_metric(m, set(schema.METRICS) | PROMQL_BUILTINS)}
        assert not unknown, (q, unknown)


# ---------------------------------------------------------------------------------------
# moeguard commands, flags and --set overrides exist
# ---------------------------------------------------------------------------------------
def moeguard_commands() -> list[tuple[str, str, list[str]]]:
    """(alert, subcommand, words) for every `moeguard ...` line of a bash block or inline code."""
    out = []
    for alert in schema.ALERTS:
        text = playbook(alert)
        lines = [ln for b in blocks(text, "bash") for ln in b.splitlines()] + re.findall(
            r"`(moeguard [^`]+)`", text
        )
        for ln in lines:
            ln = ln.split("#")[0].strip()
            if ln.startswith("moeguard "):
                words = shlex.split(re.sub(r"<[^>]*>", "X", ln))
                out.append((alert, words[1], words[2:]))
    return out


def test_moeguard_commands_and_flags_exist() -> None:
    from guard.cli import COMMANDS

    cmds = moeguard_commands()
    assert {c for _, c, _ in cmds} >= {"train", "replay", "app"}
    helps: dict[str, str | None] = {}
    for alert, cmd, words in cmds:
        assert cmd in COMMANDS, f"{alert}: moeguard {cmd} is not a command"
        if cmd not in helps:
            r = subprocess.run(
                [sys.executable, "-m", "guard", cmd, "--help"],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=120,
            )
            # a command whose module is still being written: its name is checked above
            helps[cmd] = r.stdout if r.returncode == 0 else None
            assert r.returncode == 0 or "ModuleNotFoundError" in r.stderr, r.stderr
        usage = helps[cmd]
        for flag in (w.split("=")[0] for w in words if w.startswith("--")):
            assert usage is None or flag in usage, f"{alert}: moeguard {cmd} has no {flag}"


def test_set_overrides_are_valid_config_keys() -> None:
    from trainer.config import load_config

    overrides = []
    for alert in schema.ALERTS:
        for _, words in [(a, w) for a, c, w in moeguard_commands() if a == alert and c == "train"]:
            overrides += [words[i + 1] for i, w in enumerate(words[:-1]) if w == "--set"]
        overrides += [o for o in re.findall(r"--set '?([a-z_.]+=[^'` ]+)", playbook(alert)) if "<" not in o]
    assert overrides
    from trainer.cli import parse_overrides

    for item in set(overrides):
        load_config(resource("configs", "tiny.toml"), parse_overrides([item]))  # raises ConfigError if bad
