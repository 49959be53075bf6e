"""Evaluation and reporting callbacks, composed onto any model through YAML."""

from mmssl.callbacks.captions import CaptionNaming
from mmssl.callbacks.dense_probe import DenseProbe
from mmssl.callbacks.ema import EMA
from mmssl.callbacks.guards import EvaluationBufferSync, NonFiniteGuard
from mmssl.callbacks.health import EmbeddingHealth
from mmssl.callbacks.knn import KNNProbe
from mmssl.callbacks.linear_probe import LinearProbe
from mmssl.callbacks.log_step import LogStepOnResume
from mmssl.callbacks.projector import EmbeddingProjector
from mmssl.callbacks.reconstructions import Reconstructions
from mmssl.callbacks.rng_state import RNGState
from mmssl.callbacks.summary import RunSummary
from mmssl.callbacks.throughput import Throughput
from mmssl.callbacks.zero_shot import ZeroShot

__all__ = [
    "CaptionNaming",
    "DenseProbe",
    "EMA",
    "EmbeddingHealth",
    "EmbeddingProjector",
    "EvaluationBufferSync",
    "KNNProbe",
    "LinearProbe",
    "LogStepOnResume",
    "NonFiniteGuard",
    "Reconstructions",
    "RNGState",
    "RunSummary",
    "Throughput",
    "ZeroShot",
]
