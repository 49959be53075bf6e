"""LightningModules and their building blocks."""

from mmssl.models import mae as _mae  # noqa: F401  (registers MAE's decoder, a part objectives build)
from mmssl.models.classifier import ImageClassifier

__all__ = ["ImageClassifier"]
