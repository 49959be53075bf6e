"""Memory and speed options of the models: activation checkpointing and ``torch.compile``.

* Activation checkpointing (Chen et al. 2016, "Training deep nets with sublinear memory cost"):
  each transformer block keeps only its input in the forward and recomputes its activations in
  the backward, so activation memory grows with the number of blocks times one block's input
  rather than with everything every block computes; it costs about one more forward per step.
  open_clip (``set_grad_checkpointing``) and timm (``set_grad_checkpointing``) have it for their
  towers; MAE's own encoder and decoder loops call :func:`run_blocks`.
* ``torch.compile`` of the towers, block by block ("regional compilation", the PyTorch recipe
  for models built of repeated blocks: each distinct block compiles once, not the whole model).
  ``nn.Module.compile`` works in place, so parameter names and checkpoints do not change.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

# Names of the block lists in open_clip (``Transformer.resblocks``), timm and mmssl (``blocks``).
BLOCK_LISTS = ("resblocks", "blocks")


def run_blocks(blocks: nn.ModuleList, x: Tensor, grad_checkpointing: bool = False) -> Tensor:
    """``x`` through each block in turn, checkpointed while training with gradients.

    Args:
        blocks: transformer blocks, each (B, N, D) -> (B, N, D).
        x: (B, N, D) tokens.
        grad_checkpointing: recompute each block's activations in the backward.

    Returns:
        (B, N, D) tokens after the last block.
    """
    checkpointed = grad_checkpointing and torch.is_grad_enabled()
    for block in blocks:
        # use_reentrant=False: torch's recommended variant; it works when only the parameters
        # (not the input) need gradients and keeps the RNG state for dropout / drop-path.
        x = checkpoint(block, x, use_reentrant=False) if checkpointed else block(x)
    return x


def compile_options(value: Union[bool, dict[str, Any], None], key: str = "model.compile") -> Optional[dict[str, Any]]:
    """``torch.compile`` keyword arguments from a ``compile`` key: ``False``/``None`` -> ``None``,
    ``True`` -> ``{}`` (torch's defaults), a dict (``{mode: max-autotune}``) -> itself."""
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if isinstance(value, dict):
        return dict(value)
    raise ValueError(f"{key}: true, false or a dict of torch.compile arguments, got {value!r}")


def compile_blocks(root: nn.Module, options: dict[str, Any], where: str = "model") -> list[str]:
    """Compile, in place, every block of every block list (``blocks`` / ``resblocks``) under ``root``.

    Args:
        root: the model or tower.
        options: ``torch.compile`` keyword arguments (``backend``, ``mode``, ``dynamic``, ...).
        where: name of ``root`` for the error message.

    Returns:
        The names of the block lists compiled (``visual.transformer.resblocks``, ...).

    Raises:
        ValueError: ``root`` has no block list (nothing compile would speed up by region).
    """
    compiled = []
    for name, module in root.named_modules():
        if name.rsplit(".", 1)[-1] in BLOCK_LISTS and isinstance(module, (nn.ModuleList, nn.Sequential)):
            for block in module:
                block.compile(**options)
            compiled.append(name)
    if not compiled:
        raise ValueError(f"model.compile: {where} ({type(root).__name__}) has no transformer block list "
                         f"({' / '.join(BLOCK_LISTS)}) to compile")
    return compiled


def set_clip_grad_checkpointing(model: nn.Module) -> None:
    """open_clip's ``set_grad_checkpointing`` on both towers; refuse towers where it does nothing.

    Raises:
        ValueError: naming a tower without activation checkpointing (open_clip's ResNet ignores
            the call; a timm tower without it only logs a warning).
    """
    visual = model.visual
    trunk = getattr(visual, "trunk", None)
    if type(visual).__name__ == "ModifiedResNet" or (
        trunk is not None and not hasattr(trunk, "set_grad_checkpointing")
    ):
        raise ValueError(f"model.grad_checkpointing: the image tower {type(trunk or visual).__name__} has no "
                         "activation checkpointing")
    if trunk is not None:
        trunk.set_grad_checkpointing(True)  # TimmModel's own call swallows a failure into a log line
    model.set_grad_checkpointing(True)


def apply_memory_options(
    model: nn.Module, grad_checkpointing: bool, compile: Union[bool, dict[str, Any], None]
) -> None:
    """The ``model.grad_checkpointing`` and ``model.compile`` keys of an open_clip ``CLIP``: both
    towers checkpointed (:func:`set_clip_grad_checkpointing`), their blocks compiled."""
    if grad_checkpointing:
        set_clip_grad_checkpointing(model)
    options = compile_options(compile)
    if options is not None:
        compile_blocks(model, options, "the CLIP towers")
