"""Evaluation and reporting callbacks, composed onto any model through YAML."""

from mmssl.callbacks.reconstructions import Reconstructions
from mmssl.callbacks.guards import NonFiniteGuard
from mmssl.callbacks.summary import RunSummary
from mmssl.callbacks.throughput import Throughput
from mmssl.callbacks.zero_shot import ZeroShot

__all__ = ["NonFiniteGuard", "Reconstructions", "RunSummary", "Throughput", "ZeroShot"]
