"""Where moeguard's non-Python files are: configs/, alerts/, playbooks/.

In a checkout (or an editable install) they sit beside the packages; the wheel installs them as
data files under <prefix>/share/moeguard/ (pyproject.toml [tool.setuptools.data-files]), so the
installed `moeguard train` finds its default config and `moeguard canary` its own.

    resource("configs", "tiny.toml")   # .../configs/tiny.toml, wherever it was installed
"""

from __future__ import annotations

import site
import sys
import sysconfig
from pathlib import Path

SHARE = ("share", "moeguard")


def roots() -> list[Path]:
    """Candidate roots, the checkout first."""
    here = Path(__file__).resolve().parents[1]
    out = [here, here.joinpath(*SHARE)]  # a checkout; `pip install --target DIR` puts data in DIR
    for prefix in (sysconfig.get_paths().get("data"), sys.prefix, getattr(site, "USER_BASE", None)):
        if prefix:
            out.append(Path(prefix).joinpath(*SHARE))
    return out


def resource(*parts: str) -> Path:
    """The first existing `root/parts...`; the checkout's path when none exists (so an error
    names where it was looked for)."""
    for root in roots():
        p = root.joinpath(*parts)
        if p.exists():
            return p
    return roots()[0].joinpath(*parts)
