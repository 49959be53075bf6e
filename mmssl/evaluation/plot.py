"""Accuracy-against-depth plot of a layer-wise probe, drawn with matplotlib."""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import numpy as np

from mmssl.visualize.figures import figure_to_array, new_figure, save_png


def plot_layer_accuracy(
    curves: Mapping[str, Sequence[float]],
    title: str = "linear probe accuracy per block",
    path: Optional[str] = None,
    size: tuple[int, int] = (640, 400),
) -> np.ndarray:
    """Draw one line per metric: x = block 1..depth, y = accuracy in [0, 1].

    Args:
        curves: metric name -> accuracy per block (block 1 first).
        title: text at the top.
        path: write the PNG here when given.
        size: (width, height) in pixels.

    Returns:
        The image as an (H, W, 3) uint8 array (for ``TensorBoard add_image(..., dataformats="HWC")``).
    """
    dpi = 100
    figure = new_figure(size[0] / dpi, size[1] / dpi, dpi=dpi)
    ax = figure.add_subplot()
    depth = max((len(v) for v in curves.values()), default=0)
    for name, values in curves.items():
        ax.plot(np.arange(1, len(values) + 1), np.asarray(values, dtype=float), marker="o", label=name)
    ax.set_xticks(np.arange(1, depth + 1))
    ax.set_ylim(0, 1)
    ax.set_xlabel("block")
    ax.set_ylabel("accuracy")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    if curves:
        ax.legend(fontsize=8)
    figure.tight_layout()
    if path:
        save_png(figure, path)
    return figure_to_array(figure)
