"""Just enough PromQL reading for the consistency tests: which metric names does an expr use?

Not a parser: strings, label matchers, range selectors, modifiers and `by (...)` lists are
blanked, then every identifier not followed by "(" and not a keyword is a metric name.
`test_metric_names_parser` pins the behaviour on the shapes our rules use.
"""

from __future__ import annotations

import re

_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "atan2",
    "inf",
    "nan",
}
_STRINGS = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_OFFSET = re.compile(r"\boffset\s+-?[0-9a-zA-Z]+")
_IDENT = re.compile(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def metric_names(expr: str) -> set[str]:
    s = _STRINGS.sub('""', expr)
    s = _MATCHERS.sub(" ", s)
    s = _RANGES.sub(" ", s)
    s = _GROUPING.sub(" ", s)
    s = _OFFSET.sub(" ", s)
    names = set()
    for m in _IDENT.finditer(s):
        name, call = m.group(1), m.group(2)
        if call or name.lower() in _KEYWORDS:
            continue
        names.add(name)
    return names


def label_values(expr: str, label: str) -> set[str]:
    """Values an expr matches `label` against with = or =~ (alternatives of a regex split on |)."""
    out: set[str] = set()
    for m in re.finditer(rf'\b{label}\s*(=~|=)\s*"([^"]*)"', expr):
        op, value = m.groups()
        out |= set(value.split("|")) if op == "=~" else {value}
    return out


PROMETHEUS_OWN = {"up"}  # written by Prometheus per scrape target (HeartbeatLost reads it)


def known_metric(name: str, metrics: set[str]) -> bool:
    if name in metrics or name in PROMETHEUS_OWN:
        return True
    return any(name.endswith(suf) and name[: -len(suf)] in metrics for suf in HISTOGRAM_SUFFIXES)
