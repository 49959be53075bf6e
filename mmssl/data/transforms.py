"""Train and eval image transforms (torchvision), shared by every data module and callback.

open_clip's ``image_transform`` is not reused because MAE needs a different crop scale and a flip;
one parameterised pair serves both recipes: CLIP uses scale (0.9, 1.0) and no flip (open_clip's
default), MAE uses (0.2, 1.0) with flip (MAE pretraining recipe).
"""

from __future__ import annotations

from typing import Callable, Sequence

from torchvision import transforms as T

OPENAI_MEAN: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)


def train_transform(
    image_size: int,
    mean: Sequence[float] = OPENAI_MEAN,
    std: Sequence[float] = OPENAI_STD,
    scale: tuple[float, float] = (0.9, 1.0),
    hflip: bool = False,
) -> Callable:
    """Random-resized crop (+ optional flip), to tensor, normalise.

    Args:
        image_size: output side in pixels.
        mean: per-channel normalisation mean.
        std: per-channel normalisation std.
        scale: area range of the random crop.
        hflip: add a random horizontal flip (off for captions that name left/right).

    Returns:
        A callable from a PIL image to a ``(3, image_size, image_size)`` float tensor.
    """
    steps: list[Callable] = [
        T.RandomResizedCrop(image_size, scale=scale, interpolation=T.InterpolationMode.BICUBIC),
    ]
    if hflip:
        steps.append(T.RandomHorizontalFlip())
    steps += [_to_rgb, T.ToTensor(), T.Normalize(mean, std)]
    return T.Compose(steps)


def eval_transform(
    image_size: int,
    mean: Sequence[float] = OPENAI_MEAN,
    std: Sequence[float] = OPENAI_STD,
) -> Callable:
    """Resize the short side, centre crop, to tensor, normalise (open_clip's eval transform).

    Args:
        image_size: output side in pixels.
        mean: per-channel normalisation mean.
        std: per-channel normalisation std.

    Returns:
        A callable from a PIL image to a ``(3, image_size, image_size)`` float tensor.
    """
    return T.Compose([
        T.Resize(image_size, interpolation=T.InterpolationMode.BICUBIC),
        T.CenterCrop(image_size),
        _to_rgb,
        T.ToTensor(),
        T.Normalize(mean, std),
    ])


def _to_rgb(image):  # a named function, not a lambda, so the transform pickles into workers
    return image.convert("RGB")
