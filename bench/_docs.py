"""Write one benchmark's section of docs/BENCHMARKS.md between its markers, leaving the rest alone."""

from __future__ import annotations

import os
import platform
import re
import shlex
import time
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "BENCHMARKS.md"
HEADER = "# Benchmarks\n\nEach section is written by the benchmark named in it; the command that produced it is shown.\n"


def machine_line() -> str:
    import torch

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"{time.strftime('%Y-%m-%d')}, {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
        f"load average {load:.2f} at the end"
    )


def shown_command(script: str, argv: list[str]) -> str:
    """The command line a section names, with the value of --out (a path on the machine that ran
    it) shown as OUT.json: the docs hold no machine paths."""
    shown: list[str] = []
    for i, arg in enumerate(argv):
        if i > 0 and argv[i - 1] == "--out":
            arg = "OUT.json"
        elif arg.startswith("--out="):
            arg = "--out=OUT.json"
        shown.append(arg)
    return shlex.join(["python", script, *shown])


def write_section(name: str, body: str) -> None:
    DOC.parent.mkdir(exist_ok=True)
    text = DOC.read_text() if DOC.exists() else HEADER
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in text and end in text:
        text = re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    DOC.write_text(text)
