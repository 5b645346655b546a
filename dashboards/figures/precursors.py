"""The health page's precursor chart (guard/runtime/precursor.py measures the signals): pure, data
in (from dashboards.data), figure out, in dashboards/figures/style.py's conventions."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
import polars as pl
from plotly.subplots import make_subplots

from dashboards.data import guard_events
from dashboards.figures.nonfinite_marks import mark_nonfinite_steps, panel_top
from dashboards.figures.style import (
    LEGEND_RIGHT,
    LOSS_COLOR,
    STEP_MARGIN,
    column_values,
    fit_step_axis,
    log_ticks,
    series_xy,
)
from guard.core import schema

PRECURSOR_COLOR = "#e377c2"
GROUP_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#17becf"]
MAX_SPIKE_LINES = 50  # dotted lines at the first loss-spike episodes, not a wall of them
LAYER_COLORS = ["#17becf", "#bcbd22", "#8c564b", "#7f7f7f", "#9467bd", "#d62728"]  # not the groups'
MAX_LOGIT_LAYER_LINES = 16  # per-layer max-logit lines drawn beside the max over layers
MAX_BAND = {"color": "rgba(51, 51, 51, 0.22)", "width": 8}  # the max over layers, behind the layers
QK_CLIP_TAU = 100.0  # Kimi K2's QK-clip threshold, the detector's absolute line (PrecursorConfig)


def precursor_figure(
    series: dict[str, pl.DataFrame],
    groups: dict[int, pl.DataFrame],
    events: pl.DataFrame,
    logits: dict[int, pl.DataFrame] | None = None,
    nonfinite: np.ndarray | list[int] = (),
    *,
    steps: tuple[int, int] | None = None,
) -> go.Figure:
    """The precursor signals on a shared step axis: the update ratio ||ΔW|| / ||W|| (log) with
    every precursor verdict and, as dotted lines, the loss spikes they may precede; the grad norm
    per optimizer group (log); Adam's second-moment ratio when the run measured it; the max
    attention logit per layer when it was sampled (`logits`: layer -> rows, -1 the max over
    layers, from dashboards.data.loaders.load_max_logits). `nonfinite`: the run's steps whose loss
    or grad norm was NaN/Inf (nonfinite_marks.nonfinite_steps): the signals have no value there,
    so each panel marks them as the health chart does instead of its lines just ending. `steps` =
    (first, last) step of the run: the x-axis range of every chart of the page (style.step_range)."""
    has_v = "adam_v_ratio" in series and series["adam_v_ratio"]["adam_v_ratio"].is_finite().any()
    titles = [
        "Update ratio ||ΔW|| / ||W|| (all parameters; markers: precursor verdicts)",
        "Grad norm per optimizer parameter group",
    ]
    if has_v:
        titles.append("Adam second moments: max over parameters of mean(v) / its running median")
    if logits:
        titles.append("Max attention logit per layer (sampled steps; markers: max-logit verdicts)")
    fig = make_subplots(
        rows=len(titles), cols=1, shared_xaxes=True, vertical_spacing=0.1, subplot_titles=titles
    )
    verdicts = events.filter(pl.col("kind") == schema.EV_VERDICT) if events.height else events
    _update_ratio_panel(fig, series.get("update_ratio"), verdicts)
    for k, (g, df) in enumerate(groups.items()):
        _line(fig, df, "grad_norm", f"group {g} grad norm", GROUP_COLORS[k % len(GROUP_COLORS)], row=2)
    ratio = series.get("update_ratio")
    fig.update_yaxes(type="log", title_text="||ΔW|| / ||W||", row=1, col=1, **_ticks([ratio], "update_ratio"))
    fig.update_yaxes(type="log", title_text="grad norm", row=2, col=1, **_ticks(groups.values(), "grad_norm"))
    if has_v:
        _line(fig, series["adam_v_ratio"], "adam_v_ratio", "Adam v ratio", "#bcbd22", row=3)
        v_ticks = _ticks([series["adam_v_ratio"]], "adam_v_ratio")
        fig.update_yaxes(type="log", title_text="ratio", row=3, col=1, **v_ticks)
    if logits:
        _max_logit_panel(fig, logits, verdicts, row=len(titles))
    # each panel's frames and the column it draws, in row order: the ticks sit at its top
    panels = [([ratio], "update_ratio"), (groups.values(), "grad_norm")]
    panels += [([series["adam_v_ratio"]], "adam_v_ratio")] if has_v else []
    panels += [(logits.values(), "max_logit")] if logits else []
    for row, (frames, col) in enumerate(panels, 1):
        values = [f[col].cast(pl.Float64).to_numpy() for f in frames if f is not None and f.height]
        hover = "the run's loss or grad norm non-finite: no signal at this step"
        mark_nonfinite_steps(fig, nonfinite, panel_top(values), hover=hover, row=row, first=row == 1)
    fig.update_xaxes(title_text="step", row=len(titles), col=1)
    fig.update_layout(
        title={"text": "Precursors: signals that move before a loss spike", "x": 0, "xanchor": "left"},
        height=260 * len(titles) + 80,
        legend=LEGEND_RIGHT,
        margin=STEP_MARGIN,
    )
    if steps is not None:
        fit_step_axis(fig, *steps)
    return fig


def _ticks(frames: object, col: str) -> dict[str, object]:
    """1-2-5 log ticks over a column of several frames (plotly's own print bare mantissas)."""
    vals = [f[col].cast(pl.Float64).to_numpy() for f in frames if f is not None and f.height]  # type: ignore[attr-defined]
    return log_ticks(np.concatenate(vals) if vals else [])


def _line(fig: go.Figure, df: pl.DataFrame, col: str, name: str, color: str, *, row: int) -> None:
    x, y = series_xy(df, col)
    # every panel here is log-scaled: a 0 (the update ratio of a step after an LR-0 warm-up step)
    # is a gap, not a line plunging off the panel's bottom edge
    y = np.where(y > 0, y, np.nan)
    fig.add_trace(
        go.Scatter(
            x=x,
            y=y,
            mode="lines",
            name=name,
            line={"color": color, "width": 1.2},
            hovertemplate=f"step %{{x}}<br>{name} %{{y:.3g}}<extra></extra>",
        ),
        row=row,
        col=1,
    )


def _verdict_markers(fig: go.Figure, hits: pl.DataFrame, name: str, symbol: str, what: str, row: int) -> None:
    """One marker per precursor verdict at the value that fired, the layers that fired in the hover."""
    if not hits.height:
        return
    layers = [guard_events.parse_detail(d).get("layers", []) for d in hits["detail"].to_list()]
    fig.add_trace(
        go.Scatter(
            x=column_values(hits, "step"),
            y=column_values(hits, "value"),
            mode="markers",
            name=name,
            marker={"symbol": symbol, "size": 11, "color": PRECURSOR_COLOR},
            customdata=[", ".join(map(str, ls)) for ls in layers],
            hovertemplate=f"step %{{x}}<br>{what} %{{y:.3g}}<br>layers %{{customdata}}<extra></extra>",
        ),
        row=row,
        col=1,
    )


def _update_ratio_panel(fig: go.Figure, ratio: pl.DataFrame | None, verdicts: pl.DataFrame) -> None:
    """The total update ratio, a marker per precursor verdict (at the layer ratio that fired, the
    layers in the hover) and a dotted line where each loss-spike episode starts (a verdict with
    none the step before): the lead time is the gap."""
    if ratio is not None and ratio.height:
        _line(fig, ratio, "update_ratio", "update ratio", "#555555", row=1)
    if not verdicts.height:
        return
    pre = verdicts.filter(pl.col("detector") == schema.DET_UPDATE_RATIO)
    _verdict_markers(fig, pre, "precursor: update ratio spike", "triangle-up", "layer update ratio", row=1)
    flagged = set(verdicts.filter(pl.col("detector") == schema.DET_LOSS_SPIKE)["step"].to_list())
    spikes = sorted(s for s in flagged if s - 1 not in flagged)
    for s in spikes[:MAX_SPIKE_LINES]:
        fig.add_vline(x=s, line={"color": LOSS_COLOR, "dash": "dot", "width": 1}, opacity=0.7, row=1, col=1)
    if spikes:  # the lines' legend entry
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="lines",
                name="loss spike (episode start)",
                line={"color": LOSS_COLOR, "dash": "dot"},
            ),
            row=1,
            col=1,
        )


def _max_logit_panel(
    fig: go.Figure, logits: dict[int, pl.DataFrame], verdicts: pl.DataFrame, *, row: int
) -> None:
    """Max over layers, each layer (the first MAX_LOGIT_LAYER_LINES), the QK-clip line at
    tau = 100 and a marker per max-logit verdict (the layers that fired in the hover).

    The max over layers is always one layer's value: drawn as a wide grey band behind the layers
    (a dark line over them hid the layer that holds the max), so that layer's own colour shows
    inside the band; the band's hover names the layer."""
    layers = [k for k in logits if k >= 0][:MAX_LOGIT_LAYER_LINES]
    top = logits.get(-1)
    if top is not None and top.height:
        x, y = series_xy(top, "max_logit")
        holder = _max_holder(logits, layers)
        fig.add_trace(
            go.Scatter(
                x=x,
                y=y,
                mode="lines",
                name="max logit (all layers)",
                line=MAX_BAND,
                customdata=[holder.get(int(s), "a layer not drawn") for s in x],
                hovertemplate="step %{x}<br>max logit over layers %{y:.3g}: %{customdata}<extra></extra>",
            ),
            row=row,
            col=1,
        )
    for k, layer in enumerate(layers):
        x, y = series_xy(logits[layer], "max_logit")
        fig.add_trace(
            go.Scatter(
                x=x,
                y=y,
                mode="lines",
                name=f"layer {layer} max logit",
                line={"color": LAYER_COLORS[k % len(LAYER_COLORS)], "width": 1.5},
                legendgroup="max-logit-layers",
                hovertemplate=f"step %{{x}}<br>layer {layer} max logit %{{y:.3g}}<extra></extra>",
            ),
            row=row,
            col=1,
        )
    fig.add_hline(y=QK_CLIP_TAU, line={"color": PRECURSOR_COLOR, "dash": "dash", "width": 1}, row=row, col=1)
    fig.add_annotation(
        text="Kimi K2's QK-clip τ = 100",
        x=1,
        xref="x domain",
        y=np.log10(QK_CLIP_TAU),
        yref="y",
        showarrow=False,
        xanchor="right",
        yanchor="bottom",
        font={"size": 10, "color": PRECURSOR_COLOR},
        row=row,
        col=1,
    )
    hits = verdicts.filter(pl.col("detector") == schema.DET_MAX_LOGIT) if verdicts.height else verdicts
    _verdict_markers(fig, hits, "precursor: max logit growth", "diamond", "layer max logit", row=row)
    fig.update_yaxes(type="log", title_text="max q·k / √d", row=row, col=1, **_decade_ticks(logits))


def _max_holder(logits: dict[int, pl.DataFrame], layers: list[int]) -> dict[int, str]:
    """step -> which of the drawn `layers` holds the max over all layers there ("layer 0", or
    "layers 0, 1" on a tie); a step where none of them does is left out."""
    top = logits[-1].select("step", pl.col("max_logit").alias("top"))
    frames = [logits[k].select("step", "max_logit").with_columns(layer=pl.lit(k)) for k in layers]
    if not frames:
        return {}
    held = (
        pl.concat(frames)
        .join(top, on="step")
        .filter(pl.col("max_logit") == pl.col("top"))
        .group_by("step")
        .agg(pl.col("layer").sort().cast(pl.String))
    )
    return {s: ("layer " if len(ls) == 1 else "layers ") + ", ".join(ls) for s, ls in held.iter_rows()}


def _decade_ticks(logits: dict[int, pl.DataFrame]) -> dict[str, object]:
    """1-2-5 ticks over the logits and tau; powers of ten alone past three decades (a logit that
    ran away spans six, and 1-2-5 over six decades is a wall of labels)."""
    frames = [f for f in logits.values() if f.height] + [pl.DataFrame({"max_logit": [QK_CLIP_TAU]})]
    ticks = _ticks(frames, "max_logit")
    vals = [v for v in ticks.get("tickvals", []) if v > 0]
    if vals and np.log10(max(vals) / min(vals)) > 3:
        decades = [v for v in vals if np.isclose(np.log10(v), round(np.log10(v)))]
        ticks = {**ticks, "tickvals": decades, "ticktext": [f"{v:g}" for v in decades]}
    return ticks
