"""Write one benchmark's section of docs/BENCHMARKS.md between its markers, leaving the rest alone.

Writes docs/BENCHMARKS.md › Benchmarks (the whole file): the marked section of whichever bench calls
`write_section`, none of its own.
"""

from __future__ import annotations

import os
import platform
import re
import shlex
import time
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "BENCHMARKS.md"
HEADER = "# Benchmarks\n\nEach section is written by the benchmark named in it; the command that produced it is shown.\n"


def machine_line() -> str:
    import torch

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (
        f"{time.strftime('%Y-%m-%d')}, {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
        f"load average {load:.2f} at the end"
    )


def shown_command(program: str, argv: list[str]) -> str:
    """`python PROGRAM ARGV` as a docs section names it, with every absolute path (a path of the
    machine that ran it) masked: an option's value by the option's name and the path's suffix
    (`--out /tmp/x/r.json` -> `--out OUT.json`, `--dir=/tmp/w` -> `--dir=DIR`), any other by
    PATH/ and its name. The docs hold no machine paths."""

    def masked(value: str, option: str | None) -> str:
        if not value.startswith("/"):
            return value
        path = Path(value)
        return option.lstrip("-").upper().replace("-", "_") + path.suffix if option else f"PATH/{path.name}"

    shown: list[str] = []
    for i, arg in enumerate(argv):
        previous = argv[i - 1] if i > 0 else ""
        if arg.startswith("--") and "=" in arg:
            option, value = arg.split("=", 1)
            arg = f"{option}={masked(value, option)}"
        elif not arg.startswith("-"):
            arg = masked(arg, previous if previous.startswith("--") and "=" not in previous else None)
        shown.append(arg)
    return shlex.join(["python", *shlex.split(program), *shown])


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
