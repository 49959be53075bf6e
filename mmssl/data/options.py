"""Checks of :class:`~mmssl.data.datamodule.ImageTextDataModule` values, run in its constructor.

jsonargparse checks types; these check ranges, so that a nonsense value (``shuffle_buffer: 0``, a
crop scale beyond 1) stops ``mmssl fit`` before any data is read or model built, with an error
naming the config key.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

KEY = "data.init_args.{}"


def _fail(name: str, expected: str, value: Any) -> None:
    raise ValueError(f"{KEY.format(name)} must be {expected}, got {value!r}")


def _numbers(value: Any, count: int) -> bool:
    try:
        return len(value) == count and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    except TypeError:
        return False


def check_data_options(
    batch_size: int,
    num_workers: int,
    max_bad_fraction: float,
    shuffle_buffer: int,
    image_size: int,
    train_num_samples: Optional[int],
    crop_scale: Sequence[float],
    eval_crop_pct: Optional[float],
    image_mean: Sequence[float],
    image_std: Sequence[float],
    keys: dict[str, str],
) -> None:
    """Refuse values outside their range, naming the key (``data.init_args.shuffle_buffer``).

    Args:
        batch_size, num_workers, max_bad_fraction, shuffle_buffer, image_size, train_num_samples,
            crop_scale, eval_crop_pct, image_mean, image_std: the data module's arguments.
        keys: ``image_key``, ``text_key``, ``label_key`` by name.

    Raises:
        ValueError: the first value out of range.
    """
    if batch_size < 1:
        _fail("batch_size", ">= 1", batch_size)
    if num_workers < 0:
        _fail("num_workers", ">= 0 (0 reads in the training process)", num_workers)
    if not 0.0 <= max_bad_fraction <= 1.0:
        _fail("max_bad_fraction", "in [0, 1]", max_bad_fraction)
    if shuffle_buffer < 1:
        _fail("shuffle_buffer", ">= 1 (raw samples held per worker; 1 keeps the shards' order)", shuffle_buffer)
    if image_size < 1:
        _fail("image_size", ">= 1 (pixels)", image_size)
    if train_num_samples is not None and train_num_samples < 1:
        _fail("train_num_samples", ">= 1, or unset (null) to read sizes.json", train_num_samples)
    if not _numbers(crop_scale, 2) or not 0.0 < crop_scale[0] <= crop_scale[1] <= 1.0:
        _fail("crop_scale", "[min, max] area fractions with 0 < min <= max <= 1", crop_scale)
    if eval_crop_pct is not None and not 0.0 < eval_crop_pct <= 1.0:
        _fail("eval_crop_pct", "in (0, 1] (crop side / resize side), or unset", eval_crop_pct)
    if not _numbers(image_mean, 3):
        _fail("image_mean", "three numbers (R, G, B)", image_mean)
    if not _numbers(image_std, 3) or min(image_std) <= 0:
        _fail("image_std", "three positive numbers (R, G, B)", image_std)
    for name, value in keys.items():
        if not isinstance(value, str) or not all(part.strip() for part in value.split(";")):
            _fail(name, "sample extensions (';'-separated alternatives, none empty)", value)
