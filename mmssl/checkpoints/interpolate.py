"""WiSE-FT weight interpolation (Wortsman et al. 2022) of two checkpoints of one architecture.

``theta(alpha) = (1 - alpha) * theta_start + alpha * theta_end`` for every floating-point tensor,
as ``mlfoundations/wise-ft`` ``src/wise_ft.py`` (``_merge``) does over the whole state dict: alpha
0 is the start (the zero-shot model), 1 the fine-tuned end. Pure functions over state dicts and
checkpoint dicts; no model is imported.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Optional, Sequence

import torch

from mmssl.checkpoints.layouts import StateDict
from mmssl.checkpoints.model_file import checkpoint_kind, recorded_class

# Hyper-parameters that fix a module's architecture (the others, an LR or a warm-up, may differ
# between the start and the fine-tuned end).
ARCHITECTURE_KEYS: tuple[str, ...] = (
    "model_name", "model_kwargs", "num_classes", "image_size", "global_pool", "loss", "embed_dim", "depth",
    "num_heads", "patch_size", "decoder_embed_dim", "decoder_depth",
)
DEFAULT_ALPHAS: tuple[float, ...] = tuple(round(i / 10, 1) for i in range(11))  # wise_ft.py's default


def check_alphas(alphas: Iterable[float]) -> list[float]:
    """The mixing coefficients as floats, each in [0, 1] (0: start, 1: fine-tuned end).

    Raises:
        ValueError: an alpha outside [0, 1] (or not a number), or none given.
    """
    out = []
    for alpha in alphas:
        value = float(alpha)
        if not 0.0 <= value <= 1.0:  # also refuses NaN
            raise ValueError(f"alpha {alpha!r} is outside [0, 1] (0 = the start checkpoint, 1 = the fine-tuned end)")
        out.append(value)
    if not out:
        raise ValueError("no alpha given")
    return out


def first_mismatch(start: StateDict, end: StateDict) -> Optional[str]:
    """The first reason two state dicts cannot be interpolated, or ``None``.

    Returns:
        A sentence naming the first key only one side has (in sorted order), else the first key
        whose shape or dtype kind differs.
    """
    only_start, only_end = sorted(set(start) - set(end)), sorted(set(end) - set(start))
    if only_start:
        return f"key {only_start[0]!r} is in the start checkpoint only ({len(only_start)} such keys)"
    if only_end:
        return f"key {only_end[0]!r} is in the end checkpoint only ({len(only_end)} such keys)"
    for key in sorted(start):
        a, b = start[key], end[key]
        if tuple(a.shape) != tuple(b.shape):
            return f"key {key!r} has shape {tuple(a.shape)} in the start and {tuple(b.shape)} in the end"
        if a.is_floating_point() != b.is_floating_point():
            return f"key {key!r} is {a.dtype} in the start and {b.dtype} in the end"
    return None


def interpolate_state(start: StateDict, end: StateDict, alpha: float) -> StateDict:
    """``(1 - alpha) * start + alpha * end`` per floating-point tensor, in the end's dtype.

    Integer tensors (step counters, index buffers) cannot be mixed: they are taken from the end
    for ``alpha > 0`` and from the start at 0.

    Args:
        start: the start's state dict (alpha 0).
        end: the fine-tuned end's state dict (alpha 1), the same keys and shapes.
        alpha: in [0, 1].

    Raises:
        ValueError: keys or shapes differ (the first mismatch named), or alpha outside [0, 1].
    """
    (alpha,) = check_alphas([alpha])
    problem = first_mismatch(start, end)
    if problem is not None:
        raise ValueError(f"the checkpoints cannot be interpolated: {problem}")
    out: StateDict = {}
    for key, b in end.items():
        a = start[key]
        if b.is_floating_point():
            # torch.lerp(a, b, w) = a + w (b - a), computed in fp32 for low-precision weights.
            out[key] = torch.lerp(a.float(), b.float(), alpha).to(b.dtype)
        else:
            out[key] = (b if alpha > 0 else a).clone()
    return out


def _same_model_name(a: Any, b: Any) -> bool:
    """Model names equal, or two JSON config files with the same content (a recipe's path may be
    relative to another folder than the start run's)."""
    if a == b:
        return True
    if all(isinstance(x, str) and x.endswith(".json") and os.path.isfile(x) for x in (a, b)):
        with open(a) as fa, open(b) as fb:
            return json.load(fa) == json.load(fb)
    return False


def _kind_name(path: str, checkpoint: dict[str, Any]) -> Optional[str]:
    """The checkpoint's kind (:func:`mmssl.checkpoints.model_file.checkpoint_kind`), else the class it
    records, else ``None``."""
    try:
        return checkpoint_kind(path, checkpoint).name
    except ValueError:
        return recorded_class(path, checkpoint)


def architecture_mismatch(start: dict[str, Any], end: dict[str, Any], names: Sequence[str] = ("start", "end"),
                          kinds: Optional[Sequence[str]] = None) -> Optional[str]:
    """The first way two Lightning checkpoints differ in architecture (class, a shape-setting
    hyper-parameter, a key or a shape), or ``None``.

    Args:
        start: the start's checkpoint dict (``state_dict``, ``hyper_parameters``).
        end: the end's.
        names: the two files (their runs' ``config.yaml`` tell a class the checkpoints do not record).
        kinds: the two kinds' names when the caller has told them (a checkpoint made in memory).
    """
    kinds = list(kinds) if kinds is not None else [_kind_name(name, ckpt) for name, ckpt in zip(names, (start, end))]
    if kinds[0] != kinds[1]:
        return f"the start is a {kinds[0]} checkpoint and the end a {kinds[1]} one"
    hp_start, hp_end = start.get("hyper_parameters") or {}, end.get("hyper_parameters") or {}
    for key in ARCHITECTURE_KEYS:
        a, b = hp_start.get(key), hp_end.get(key)
        same = _same_model_name(a, b) if key == "model_name" else a == b
        if not same:
            return f"hyper-parameter {key!r} is {a!r} in the start and {b!r} in the end"
    return first_mismatch(start["state_dict"], end["state_dict"])


def interpolate_checkpoints(start: dict[str, Any], end: dict[str, Any], alpha: float,
                            names: Sequence[str] = ("start", "end"),
                            kinds: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """A Lightning checkpoint of the end's kind and hyper-parameters, weights mixed at ``alpha``.

    It holds what :func:`mmssl.checkpoints.load.load_lightning` reads (``state_dict``,
    ``hyper_parameters``) plus ``wise_ft: {alpha}``; no optimizer or loop state (it is a model,
    not a point to resume training from).

    Args:
        start: the start's checkpoint dict.
        end: the fine-tuned end's.
        alpha: in [0, 1].
        names: the two files, named in errors.
        kinds: see :func:`architecture_mismatch`.

    Raises:
        ValueError: another architecture, keys or shapes (the first mismatch named), or alpha outside [0, 1].
    """
    problem = architecture_mismatch(start, end, names, kinds)
    if problem is not None:
        raise ValueError(f"{names[0]} and {names[1]} cannot be interpolated: {problem}")
    state = interpolate_state(start["state_dict"], end["state_dict"], alpha)
    return {"state_dict": state, "hyper_parameters": dict(end.get("hyper_parameters") or {}),
            "wise_ft": {"alpha": float(alpha), "start": names[0], "end": names[1]}}
