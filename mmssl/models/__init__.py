"""LightningModules and their building blocks."""

from mmssl.models.classifier import ImageClassifier

__all__ = ["ImageClassifier"]
