"""Print the `uv pip install` options that make uv resolve from where pip would (one per line).

scripts/bootstrap installs with uv when it can (the same resolution in about half the wall time and
a quarter of the CPU: docs/BENCHMARKS.md, "CI duration"), but uv reads neither pip's config files
nor its PIP_* variables. This hands uv pip's effective index settings (the index, the extra
indexes, find-links, constraints, trusted hosts and no-index) from `pip config list`, which lists
the PIP_* variables as `:env:` and each file's `global.` / `install.` keys, and pip's CA bundle
for SSL_CERT_FILE.

    python scripts/uv_args_from_pip.py          # uv's flags, from `python -m pip config list`
    python scripts/uv_args_from_pip.py --cert   # pip's CA bundle (for SSL_CERT_FILE), if set
"""

from __future__ import annotations

import ast
import subprocess
import sys

# pip's option -> uv pip install's flag; multi-valued options are whitespace-separated in pip's config
FLAGS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
    "trusted-host": "--allow-insecure-host",  # a mirror without TLS, or with a certificate to skip
}
MULTI = {"extra-index-url", "find-links", "constraint", "trusted-host"}
TRUE = {"1", "true", "yes", "on"}
# the later wins: the config files' global section, their install section, then the environment
PRECEDENCE = ("global", "install", ":env:")


def effective(config_list: str) -> dict[str, str]:
    """pip's effective value of each option in `pip config list` output (`section.key='value'`)."""
    found: dict[str, dict[str, str]] = {}
    for line in config_list.splitlines():
        key, sep, raw = line.partition("=")
        section, dot, name = key.rpartition(".")
        if not sep or not dot or section not in PRECEDENCE:
            continue
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        found.setdefault(name, {})[section] = str(value)
    return {name: by[next(s for s in reversed(PRECEDENCE) if s in by)] for name, by in found.items()}


def uv_args(options: dict[str, str]) -> list[str]:
    """uv's flags for pip's options: each value of a multi-valued option repeats its flag."""
    out: list[str] = []
    for name, flag in FLAGS.items():
        if name in options:
            for value in options[name].split() if name in MULTI else [options[name]]:
                out += [flag, value]
    if options.get("no-index", "").lower() in TRUE:  # an air-gapped host: find-links only
        out.append("--no-index")
    if "extra-index-url" in options or "find-links" in options:
        # pip takes the best version across every index; uv by default stops at the first that has
        # the package, which can miss a newer release another one holds
        out += ["--index-strategy", "unsafe-best-match"]
    return out


def main(argv: list[str]) -> int:
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    options = effective(listed)
    if argv == ["--cert"]:
        print(options.get("cert", ""))
    elif not argv:
        print("\n".join(uv_args(options)))
    else:
        print(f"usage: {sys.argv[0]} [--cert] (got {' '.join(argv)!r})", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
