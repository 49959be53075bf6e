"""Accuracy-against-depth plot of a layer-wise probe, drawn with Pillow.

matplotlib is not a dependency of mmssl (nor installed in its CI image); a line chart of a few
dozen points is a few dozen lines of ``ImageDraw``, so the plot costs no new dependency.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import numpy as np
from PIL import Image, ImageDraw

COLORS = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40))  # matplotlib's tab10


def plot_layer_accuracy(
    curves: Mapping[str, Sequence[float]],
    title: str = "linear probe accuracy per block",
    path: Optional[str] = None,
    size: tuple[int, int] = (640, 400),
) -> np.ndarray:
    """Draw one line per metric: x = block 1..depth, y = accuracy in [0, 1].

    Args:
        curves: metric name -> accuracy per block (block 1 first), all the same length.
        title: text at the top.
        path: write the PNG here when given.
        size: (width, height) in pixels.

    Returns:
        The image as an (H, W, 3) uint8 array (for ``TensorBoard add_image(..., dataformats="HWC")``).
    """
    width, height = size
    left, right, top, bottom = 56, 20, 36, 44
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    depth = max((len(v) for v in curves.values()), default=0)

    def xy(block: int, acc: float) -> tuple[float, float]:
        x = left + (block - 1) / max(1, depth - 1) * (width - left - right)
        return x, top + (1.0 - acc) * (height - top - bottom)

    draw.text((left, 10), title, fill="black")
    draw.rectangle((left, top, width - right, height - bottom), outline="black")
    for tick in np.linspace(0, 1, 6):
        _, y = xy(1, float(tick))
        draw.line((left - 4, y, left, y), fill="black")
        draw.line((left + 1, y, width - right - 1, y), fill=(225, 225, 225))
        draw.text((8, y - 6), f"{tick:.1f}", fill="black")
    for block in range(1, depth + 1):
        x, _ = xy(block, 0.0)
        draw.line((x, height - bottom, x, height - bottom + 4), fill="black")
        draw.text((x - 4, height - bottom + 8), str(block), fill="black")
    draw.text((width // 2 - 20, height - 18), "block", fill="black")
    for i, (name, values) in enumerate(curves.items()):
        color = COLORS[i % len(COLORS)]
        points = [xy(b + 1, float(v)) for b, v in enumerate(values)]
        if len(points) > 1:
            draw.line(points, fill=color, width=2)
        for x, y in points:
            draw.ellipse((x - 3, y - 3, x + 3, y + 3), fill=color)
        draw.text((width - right - 150, top + 8 + 14 * i), name, fill=color)
    if path:
        image.save(path)
    return np.asarray(image)
