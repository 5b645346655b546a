"""Run tags: meta.json["tags"], a list of short strings every entry point can set (`moeguard
train --tag X` / `tags = [...]` in its config, GuardedStep(tags=...), MoEGuardCallback(tags=...),
the torchtitan launcher's `--tag X`), so the Runs page can filter runs by them. One rule for what a
tag may be, here; readers take whatever a run has with `run_tags` (a run without tags has none).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from guard.core.schema import META_TAGS

MAX_TAG_LEN = 64
MAX_TAGS = 32


def clean_tags(tags: Iterable[str] | str | None, where: str = "tags") -> list[str]:
    """The tags as meta.json keeps them: stripped, first occurrence kept, in the order given.
    ValueError naming `where` for a tag that is not a non-empty string of at most MAX_TAG_LEN
    characters, or for more than MAX_TAGS tags. A single string is one tag, not its letters."""
    if tags is None:
        return []
    if isinstance(tags, str):
        tags = [tags]
    out: list[str] = []
    for t in tags:
        if not isinstance(t, str) or not t.strip() or len(t.strip()) > MAX_TAG_LEN:
            raise ValueError(
                f"{where}: {t!r} is not a tag (a non-empty string of at most {MAX_TAG_LEN} characters)"
            )
        if t.strip() not in out:
            out.append(t.strip())
    if len(out) > MAX_TAGS:
        raise ValueError(f"{where}: {len(out)} tags, at most {MAX_TAGS}")
    return out


def run_tags(meta: dict[str, Any] | None) -> list[str]:
    """A run's tags from its meta.json: [] for a run written before tags (or with a damaged entry)."""
    tags = (meta or {}).get(META_TAGS)
    if not isinstance(tags, list):
        return []
    return [t for t in tags if isinstance(t, str) and t]
