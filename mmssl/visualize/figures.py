"""matplotlib figures of the visualisation tools: map overlays and scaling plots.

Figures are built on ``matplotlib.figure.Figure`` with the Agg canvas, never through pyplot, so
nothing depends on (or changes) a global backend and a training process with no display can draw.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def new_figure(width: float, height: float, dpi: int = 100) -> Figure:
    """A figure of ``width`` x ``height`` inches on an Agg canvas."""
    figure = Figure(figsize=(width, height), dpi=dpi)
    FigureCanvasAgg(figure)
    return figure


def figure_to_array(figure: Figure) -> np.ndarray:
    """Render to an (H, W, 3) uint8 array (for TensorBoard ``add_image(..., dataformats="HWC")``)."""
    figure.canvas.draw()
    return np.asarray(figure.canvas.buffer_rgba())[..., :3].copy()


def save_png(figure: Figure, path: str, dpi: Optional[int] = None) -> str:
    """Write the figure as a PNG (at ``dpi``, default the figure's); returns ``path``."""
    figure.savefig(path, format="png", dpi=dpi or figure.dpi)
    return path


def overlay_grid(
    image: np.ndarray,
    maps: Sequence[np.ndarray],
    titles: Sequence[str],
    title: str = "",
    columns: int = 6,
    alpha: float = 0.55,
    cmap: str = "jet",
    panel_inches: float = 1.8,
) -> Figure:
    """The input image, then each map over it, one panel each.

    Args:
        image: (H, W, 3) floats in [0, 1] (the model's input, un-normalised).
        maps: (h, w) maps over the patch grid; each is stretched over the whole image
            (bilinear) and scaled to its own [min, max], so each panel shows where its map is high.
        titles: one per map.
        title: above the grid.
        columns: panels per row.
        alpha: opacity of the maps.
        cmap: matplotlib colour map of the maps.
        panel_inches: side of one panel.

    Returns:
        The figure.
    """
    if len(maps) != len(titles):
        raise ValueError(f"{len(maps)} maps but {len(titles)} titles")
    panels = 1 + len(maps)
    cols = min(columns, panels)
    rows = math.ceil(panels / cols)
    heading = 0.3 if title else 0.0  # inches kept free above the panels' own titles
    figure = new_figure(cols * panel_inches, rows * (panel_inches + 0.2) + heading)
    axes = figure.subplots(rows, cols, squeeze=False)
    height, width = image.shape[:2]
    extent = (0, width, height, 0)  # the map's cells lie over the image's patches
    for ax in axes.flat:
        ax.set_axis_off()
    axes.flat[0].imshow(image, extent=extent)
    axes.flat[0].set_title("input", fontsize=8)
    for ax, values, name in zip(axes.flat[1:], maps, titles):
        ax.imshow(image, extent=extent)
        ax.imshow(np.asarray(values, dtype=np.float32), cmap=cmap, alpha=alpha, extent=extent,
                  interpolation="bilinear", vmin=float(np.min(values)), vmax=float(np.max(values)))
        ax.set_title(name, fontsize=8)
    if title:
        figure.suptitle(title, fontsize=9)
    figure.tight_layout(pad=0.3, rect=(0, 0, 1, 1 - heading / figure.get_figheight()))
    return figure


def scaling_figure(
    compute: np.ndarray,
    loss: np.ndarray,
    spread: Optional[np.ndarray],
    curve_compute: np.ndarray,
    curve_loss: np.ndarray,
    label: str,
    asymptote: Optional[float] = None,
    metric: str = "val/loss",
) -> Figure:
    """Points with their spread and the fitted curve, on log-log axes.

    Args:
        compute: (N,) training FLOPs of the points.
        loss: (N,) their losses.
        spread: (N,) standard deviations (error bars) or ``None``.
        curve_compute: (M,) FLOPs where the fit is drawn.
        curve_loss: (M,) fitted losses there.
        label: legend of the fit.
        asymptote: the fit's irreducible loss c, drawn dashed.
        metric: y-axis label.
    """
    figure = new_figure(6.4, 4.4)
    ax = figure.add_subplot()
    ax.errorbar(compute, loss, yerr=spread, fmt="o", color="tab:blue", capsize=3, label="runs")
    ax.plot(curve_compute, curve_loss, color="tab:orange", label=label)
    if asymptote is not None and asymptote > 0:
        ax.axhline(asymptote, color="tab:gray", linestyle="--", linewidth=1, label=f"c = {asymptote:.3g}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("training compute C (FLOPs)")
    ax.set_ylabel(metric)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    figure.tight_layout()
    return figure


def curves_figure(curves: Sequence[tuple[str, np.ndarray, np.ndarray]], metric: str = "val/loss") -> Figure:
    """Each run's ``metric`` against its training compute so far, log-log.

    Args:
        curves: (name, compute (K,), loss (K,)) per run.
        metric: y-axis label.
    """
    figure = new_figure(6.4, 4.4)
    ax = figure.add_subplot()
    for name, compute, loss in curves:
        ax.plot(compute, loss, marker=".", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("training compute so far (FLOPs)")
    ax.set_ylabel(metric)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    figure.tight_layout()
    return figure
