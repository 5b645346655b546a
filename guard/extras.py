"""The optional parts of moeguard and the extra that installs each, named once.

`pip install moeguard` is what a guarded training job imports (torch, numpy, the run-store writer,
an HTTP client); the services and the app are extras (pyproject.toml [project.optional-dependencies]
uses the same names). A part whose extra is missing fails with one line naming it:

    require("collector", "moeguard collector")
    # MissingExtra: moeguard collector needs the 'collector' extra: pip install "moeguard[collector]"
"""

from __future__ import annotations

import importlib.util

# extra -> the modules it provides (the first missing one is named in the error)
EXTRAS: dict[str, tuple[str, ...]] = {
    "collector": ("starlette", "uvicorn", "prometheus_client"),
    "app": ("streamlit", "plotly"),
    "otel": ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http"),
    "grafana": ("grafana_client",),
    "profile": ("torch_tb_profiler",),
    # the frameworks the adapters drive (pinned in pyproject.toml as CI tests them)
    "torchtitan": ("torchtitan",),
    "transformers": ("transformers", "accelerate"),
}


class MissingExtra(ImportError):
    """An optional part was used without its extra; the message is one line that names it."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        # raised while the framework's own ImportError is handled: that one is not shown with it
        self.__suppress_context__ = True


def missing(extra: str) -> str | None:
    """The first module of `extra` that cannot be imported, or None when all can."""
    for mod in EXTRAS[extra]:
        try:
            if importlib.util.find_spec(mod) is None:
                return mod
        except ModuleNotFoundError:  # a parent package is missing
            return mod
    return None


def require(extra: str, what: str) -> None:
    """Raise MissingExtra unless every module of `extra` can be imported."""
    mod = missing(extra)
    if mod is not None:
        raise MissingExtra(
            f'{what} needs the {extra!r} extra: pip install "moeguard[{extra}]" (no module {mod!r})'
        )
