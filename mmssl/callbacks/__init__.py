"""Evaluation and reporting callbacks, composed onto any model through YAML."""

from mmssl.callbacks.reconstructions import Reconstructions
from mmssl.callbacks.summary import RunSummary
from mmssl.callbacks.zero_shot import ZeroShot

__all__ = ["Reconstructions", "RunSummary", "ZeroShot"]
