"""Checkpoints as ``mmssl.callbacks.EMA`` writes them (WeightAveraging's convention), with an
average far from the raw weights, for the tools' ``--ema`` tests."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import nn


def two_models(build: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module]:
    """The raw model (seed 0) and an 'average' built from seed 1: every figure of the two differs."""
    torch.manual_seed(0)
    raw = build().eval()
    torch.manual_seed(1)
    return raw, build().eval()


def save_checkpoint(path: Path, raw: nn.Module, average: nn.Module | None, class_path: str) -> str:
    """A Lightning checkpoint of ``raw`` recording ``class_path``; with ``average``, as the EMA
    callback writes one: ``state_dict`` the average, ``current_model_state`` the raw weights."""
    hparams = {**dict(raw.hparams), "_class_path": class_path}
    if average is None:
        torch.save({"state_dict": raw.state_dict(), "hyper_parameters": hparams}, path)
    else:
        torch.save({"state_dict": average.state_dict(), "current_model_state": raw.state_dict(),
                    "averaging_state": {"n_averaged": torch.tensor(3)}, "hyper_parameters": hparams}, path)
    return str(path)
