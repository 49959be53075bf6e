"""Images for the visualisation tools: the model's input and the same view for display."""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor, nn
from torchvision import transforms as T

from mmssl.data.transforms import eval_transform


def load_images(paths: Sequence[str], model: nn.Module, display_size: int = 256) -> tuple[Tensor, list[np.ndarray]]:
    """Read image files as the model sees them, and the same crop at a legible resolution.

    Args:
        paths: image files.
        model: has ``image_size``, ``image_mean``, ``image_std`` (every loader of
            ``mmssl.evaluation.encoders`` sets them).
        display_size: the display crop's side is the image's short side, clipped to
            [``model.image_size``, ``display_size``]: a 32-pixel model input is not all one sees.

    Returns:
        ``(images, views)``: (B, 3, S, S) normalised model inputs (open_clip's eval transform:
        resize the short side, centre crop) and per image an (s, s, 3) float array in [0, 1] of
        the same field of view.
    """
    transform = eval_transform(model.image_size, model.image_mean, model.image_std)
    inputs, views = [], []
    for path in paths:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--images: no image file at {path!r}")
        try:
            with Image.open(path) as raw:
                image = raw.convert("RGB")
        except (UnidentifiedImageError, OSError) as err:
            raise ValueError(f"--images: {path!r} is not a readable image ({err})") from err
        inputs.append(transform(image))
        side = int(np.clip(min(image.size), model.image_size, display_size))
        view = T.CenterCrop(side)(T.Resize(side, interpolation=T.InterpolationMode.BICUBIC)(image))
        views.append(np.asarray(view, dtype=np.float32) / 255.0)
    return torch.stack(inputs), views
