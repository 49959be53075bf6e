"""open_clip's 0-d ``logit_scale`` / ``logit_bias`` under sharding: a part CLIP (and CoCa) take.

FSDP 1 and FSDP2 shard parameters along dim 0 and refuse 0-d ones ("doesn't support scalar
parameters"), so a sharded run holds them with shape (1,) (:func:`scalars_as_vectors`); the losses
broadcast them either way. Checkpoints keep open_clip's 0-d shape where the weights are whole
(:func:`install_scalar_hooks`); a sharded (DCP) checkpoint keeps (1,) and names the entries under
``SCALAR_KEYS``, which the one reader turns back to 0-d when it consolidates the folder.
"""

from __future__ import annotations

from typing import Any

import torch

from mmssl.checkpoints.read import SCALAR_KEYS

NAMES = ("logit_scale", "logit_bias")


def scalars_as_vectors(model: torch.nn.Module) -> None:
    """Give ``model.logit_scale`` / ``logit_bias`` (an open_clip model's) shape (1,), same values."""
    for key in NAMES:
        param = getattr(model, key, None)
        if isinstance(param, torch.nn.Parameter) and param.ndim == 0:
            setattr(model, key, torch.nn.Parameter(param.detach().reshape(1), requires_grad=param.requires_grad))


def _to_open_clip_shape(module: torch.nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """``state_dict`` post-hook: the scalars saved 0-d, open_clip's shape. An FSDP2 shard (a
    DTensor) cannot be reshaped and stays (1,): the sharded checkpoint names it (SCALAR_KEYS)."""
    for key in NAMES:
        name = f"{prefix}model.{key}"
        if name in state_dict and state_dict[name].ndim == 1 and not hasattr(state_dict[name], "full_tensor"):
            state_dict[name] = state_dict[name].reshape(())


def _to_own_shape(module: torch.nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """``load_state_dict`` pre-hook: the scalars loaded in this process's shape (0-d, or (1,) sharded)."""
    for key in NAMES:
        param, name = getattr(module.model, key, None), f"{prefix}model.{key}"
        if param is not None and name in state_dict and state_dict[name].numel() == 1:
            state_dict[name] = state_dict[name].reshape(param.shape)


def install_scalar_hooks(module: torch.nn.Module) -> None:
    """Checkpoints of ``module`` (a LightningModule holding an open_clip ``model``) keep the
    scalars 0-d whatever shape they have in this process, and load into either shape."""
    module.register_state_dict_post_hook(_to_open_clip_shape)
    module.register_load_state_dict_pre_hook(_to_own_shape)


def record_scalar_keys(model: torch.nn.Module, checkpoint: dict[str, Any]) -> None:
    """Name the scalars in ``checkpoint`` (``model.logit_scale``, ...) for the reader of a sharded one."""
    checkpoint[SCALAR_KEYS] = [f"model.{k}" for k in NAMES if getattr(model, k, None) is not None]
