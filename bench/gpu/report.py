"""Merge the part files of `bench/gpu/run.sh` into $OUT/gpu.json and $OUT/gpu.md (the "GPU"
section for docs/BENCHMARKS.md).

    python -m bench.gpu.report --work WORK --out OUT [--dry]

A part whose file is missing or whose process run.sh's `timeout` killed is still in gpu.json, with
what it finished, its exit status and the tail of its log: one part's failure never loses the
others' figures.

Writes docs/BENCHMARKS.md › GPU (its `gpu.md`, pasted under the area heading).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.gpu.common import FORMAT, INSTALL_BOX_S, PARTS, STATUS_OK, STATUS_PARTIAL, TARGET_MFU_AGREE_PP

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_RCS = (124, 137)  # `timeout`'s exit status, and SIGKILL after its -k grace


def commit() -> str:
    """$MOEGUARD_COMMIT (a GPU machine may get the tree without git), else git, else .git's files."""
    if os.environ.get("MOEGUARD_COMMIT"):
        return os.environ["MOEGUARD_COMMIT"]
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        if sha:
            return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return _commit_from_files(REPO / ".git") or "unknown (no git; set MOEGUARD_COMMIT)"


def _commit_from_files(git: Path) -> str | None:
    try:
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head[:7]
        ref = head[5:]
        if (git / ref).is_file():
            return (git / ref).read_text().strip()[:7]
        for line in (git / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split()[0][:7]
    except OSError:
        pass
    return None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def merge(work: Path, *, dry: bool) -> dict[str, Any]:
    parts: dict[str, Any] = {}
    device: dict[str, Any] = {}
    for p in PARTS:
        got = _read_json(work / f"{p.name}.json")
        rc_line = _tail(work / f"{p.name}.rc").split()
        rc = int(rc_line[0]) if rc_line else None
        took = float(rc_line[1]) if len(rc_line) > 1 else None
        entry: dict[str, Any] = {"box_s": p.dry_box_s if dry else p.box_s, "exit": rc, "took_s": took}
        if got is None:
            why = "never started" if rc is None else f"exit {rc}, no part file"
            if rc in TIMEOUT_RCS:
                why = f"timed out after its {entry['box_s']} s box, before writing anything"
            entry.update(status=f"failed: {why}", results={}, not_done=[{"what": p.name, "why": why}])
        else:
            entry.update(status=got["status"], results=got["results"], not_done=got["not_done"])
            device = device or got["results"].get("device", {})
            if rc in TIMEOUT_RCS:
                entry["status"] = f"{STATUS_PARTIAL}: timed out after its {entry['box_s']} s box"
                entry["not_done"].append({"what": "the rest of the part", "why": "killed at its time box"})
            elif rc not in (0, None) and entry["status"] in (STATUS_OK, STATUS_PARTIAL):
                entry["status"] = f"failed: exit {rc}"
        if entry["status"] != STATUS_OK:
            entry["log_tail"] = _tail(work / f"{p.name}.log")
        parts[p.name] = entry
    return {
        "format": FORMAT,
        "dry": dry,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit(),
        "device": device,
        "install": _read_json(work / "install.json") or {"status": "not run"},
        "install_box_s": INSTALL_BOX_S,
        "parts": parts,
    }


def _pct(x: Any, digits: int = 2) -> str:
    return f"{x:+.{digits}%}" if isinstance(x, int | float) else "n/a"


def _ci(ci: Any) -> str:
    return f"{ci[0]:+.2%} .. {ci[1]:+.2%}" if isinstance(ci, list) and None not in ci else "n/a"


def _num(x: Any, fmt: str = ".2f") -> str:
    return format(x, fmt) if isinstance(x, int | float) else "n/a"


def markdown(res: dict[str, Any]) -> str:
    dev, parts = res["device"], res["parts"]
    head = (
        f"{dev.get('device', '?')}, torch {dev.get('torch', '?')}, CUDA {dev.get('cuda')}, "
        f"transformers {dev.get('transformers', '?')}, torchtitan {dev.get('torchtitan', '?')}; "
        f"{res['date']}; commit {res['commit']}"
    )
    kind = "DRY RUN on CPU (tiny sizes: proves the script, no figure means anything)" if res["dry"] else head
    lines = [
        "## GPU",
        "",
        "`bench/gpu/run.sh` (`--help` says what each part measures and its time box; `--dry` runs the same",
        "code on CPU in CI). " + kind,
        "",
        "| part | status | took |",
        "|---|---|---|",
    ]
    for name, e in parts.items():
        lines.append(f"| {name} | {e['status']} | {_num(e.get('took_s'), '.0f')} s of {e['box_s']} s |")
    lines += ["", *_figures(parts)]
    undone = [
        f"- {n}: {x['what']}: {x['why'].splitlines()[0][:200]}"
        for n, e in parts.items()
        for x in e["not_done"]
    ]
    if undone:
        lines += ["", "Not done:", *undone]
    return "\n".join(lines) + "\n"


def _figures(parts: dict[str, Any]) -> list[str]:
    out = ["| measure | figure | target |", "|---|---|---|"]
    tt, hf = parts["torchtitan"]["results"], parts["hf_trainer"]["results"]
    for label, r in (("torchtitan Trainer", tt), ("transformers Trainer", hf)):
        o = r.get("overhead")
        if isinstance(o, dict):
            a = o.get("step_s_plain", o.get("median_step_s_plain"))
            b = o.get("step_s_guarded", o.get("median_step_s_guarded"))
            out.append(
                f"| guard overhead, {label} ({o.get('pairs')} pairs; step {_num(a * 1e3 if a else None, '.1f')} "
                f"-> {_num(b * 1e3 if b else None, '.1f')} ms) | **{_pct(o.get('overhead'))}** "
                f"(95% CI {_ci(o.get('overhead_ci95'))}) | <= +1% |"
            )
        s = r.get("syncs")
        if isinstance(s, dict):
            out.append(
                f"| host syncs a step, {label} (plain -> guarded) | {_num(s['plain_per_step'], 'g')} -> "
                f"{_num(s['guarded_per_step'], 'g')} (**{_num(s['guard_extra_per_step'], '+g')}**) | +1 |"
            )
        elif isinstance(s, str):
            out.append(f"| host syncs a step, {label} | {s} | +1 |")
    m = tt.get("mfu")
    if isinstance(m, dict):
        pk = m.get("peaks", {})
        out.append(
            f"| MFU, ours vs torchtitan's mfu(%) (guarded launches; plain {_num(m.get('torchtitan_plain_pct'))}%) "
            f"| {_num(m.get('ours_pct'))}% vs {_num(m.get('torchtitan_pct'))}% (diff {_num(m.get('diff_pp'), '+.2f')} pp; "
            f"peaks {_num(pk.get('ours'), '.3g')} / {_num(pk.get('torchtitan'), '.3g')}) | within 2 pp |"
        )
        if isinstance(m.get("diff_pp"), float) and abs(m["diff_pp"]) > TARGET_MFU_AGREE_PP:
            out.append(
                "| (MFU differs by more than 2 pp: both use torchtitan's FLOPs a token; ours divides by "
                "the guard's per-step wall time, torchtitan's by its log interval, which holds its own "
                "logging; compare the peaks above first) | | |"
            )
    for key, r in parts["matrix"]["results"].items():
        if key.startswith("matrix ") and isinstance(r, dict):
            cells = "; ".join(
                f"{c['cell']}: MFU {_num((c.get('mfu_median') or 0) * 100, '.1f')}%, x{_num(c.get('ratio_median'), '.3f')}"
                f" ({c.get('judged') or c.get('status')})"
                for c in r["cells"]
            )
            out.append(f"| kernel {key} | {cells} | - |")
    for key, r in parts["canary"]["results"].items():
        if isinstance(r, dict) and "verdict" in r:
            out.append(
                f"| A/B canary, {key} ({r['n_pairs']} pairs) | {r['verdict']} (B/A {_num(r['ratio_median'], '.4f')}, "
                f"interval {_num((r['ci'] or [None])[0], '.4f')} .. {_num((r['ci'] or [None, None])[1], '.4f')}) "
                f"| {r['expected']} |"
            )
    act = parts["acting"]["results"]
    for key, want in (("nan", "skip, all unchanged"), ("spike x50", "flagged, applied (kept as unguarded)")):
        r = act.get(key)
        if isinstance(r, dict):
            out.append(
                f"| guard on {key} at step {r['step']} ({act.get('model_device', '?')}) | {r['action']}, "
                f"unchanged: {', '.join(k for k, v in r['unchanged'].items() if v) or 'none'} | {want} |"
            )
    c = act.get("collapse")
    if isinstance(c, dict):
        out.append(
            f"| forced collapse, layer {c['layer']} at step {c['at']} | bias_correct from {c['bias_correct_from']}, "
            f"recovered at {c['recovered_at']}, MaxVio after {_num(c['maxvio_after_recovery'])} | corrected |"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.report", description=__doc__)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dry", action="store_true")
    a = ap.parse_args(argv)
    res = merge(a.work, dry=a.dry)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "gpu.json").write_text(json.dumps(res, indent=1, default=str, allow_nan=True))
    md = markdown(res)
    (a.out / "gpu.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
