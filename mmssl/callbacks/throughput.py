"""Samples/s and step time for mmssl's dict batches, through Lightning's ThroughputMonitor."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ThroughputMonitor


def batch_images(batch: Any) -> int:
    """Number of samples in an mmssl batch (``{"image": (B, 3, H, W), ...}``)."""
    return int(batch["image"].shape[0])


class Throughput(ThroughputMonitor):
    """Lightning's ``ThroughputMonitor`` set up for mmssl batches, usable from YAML.

    ``ThroughputMonitor`` needs a ``batch_size_fn`` callable, which a YAML file cannot express;
    this subclass supplies it. Logs ``train|device/samples_per_sec``, ``train|batches_per_sec``
    and ``train/time`` (and, on 2+ ranks, the global figures), every ``log_every_n_steps``.

    Args:
        window_size: number of batches the rates are averaged over.
    """

    def __init__(self, window_size: int = 50) -> None:
        super().__init__(batch_size_fn=batch_images, window_size=window_size)
