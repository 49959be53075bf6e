"""LoRA checkpoints made plain for export: the base rebuilt, the adapters merged into its weights.

Every export format reads a checkpoint through :func:`mmssl.export.export_checkpoint`, which
passes a LoRA checkpoint (one with ``lora_base``) through :func:`merged_checkpoint` first, so
timm, open_clip and transformers receive ordinary weights of the model's own architecture and
need no peft to load them.
"""

from __future__ import annotations

from typing import Any

from mmssl.checkpoints.layouts import ModelKind
from mmssl.checkpoints.load import build_module
from mmssl.models.lora import LORA_BASE, merge_lora


def merged_checkpoint(path: str, checkpoint: dict[str, Any], kind: ModelKind) -> dict[str, Any]:
    """``checkpoint`` as if trained without LoRA: the merged model's full ``state_dict``.

    Args:
        path: the checkpoint file, named in errors.
        checkpoint: its contents; returned unchanged when it holds no adapters.
        kind: its row of the table of model kinds.

    Returns:
        A checkpoint whose ``hyper_parameters`` have no ``lora`` (nor base files) and whose
        ``state_dict`` :func:`mmssl.checkpoints.load.build_module` loads strictly.
    """
    if not checkpoint.get(LORA_BASE):
        return checkpoint
    module = build_module(path, checkpoint, kind)  # base from its files, then the adapters
    merge_lora(module.model)
    hparams = dict(checkpoint.get("hyper_parameters") or {}, lora=None)
    hparams.update({k: None for k in kind.base_args if k in hparams})
    out = {k: v for k, v in checkpoint.items() if k != LORA_BASE}
    out.update(state_dict=module.state_dict(), hyper_parameters=hparams)
    return out
