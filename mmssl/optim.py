"""Optimizer helpers shared by every LightningModule: weight-decay groups and the LR schedule.

Why not timm's ``param_groups_weight_decay`` alone: open_clip and MAE also exclude named
parameters (``logit_scale``, ``pos_embed``, ``cls_token``, ``mask_token``) that are not 1-D, so the
rule here is "1-D, or a name in ``no_decay_names``", which covers both recipes.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

# Parameter-name fragments never decayed (MAE: pos_embed, cls_token, mask_token; open_clip:
# logit_scale, logit_bias, positional_embedding, class_embedding, token_embedding).
DEFAULT_NO_DECAY: tuple[str, ...] = (
    "pos_embed",
    "cls_token",
    "mask_token",
    "logit_scale",
    "logit_bias",
    "positional_embedding",
    "class_embedding",
    "token_embedding",
)


def param_groups(
    module: nn.Module,
    weight_decay: float | None = None,
    no_decay_names: Iterable[str] = DEFAULT_NO_DECAY,
) -> list[dict]:
    """Split trainable parameters into a decayed and a non-decayed group.

    Args:
        module: the model whose ``requires_grad`` parameters are grouped.
        weight_decay: decay of the first group; ``None`` leaves it to the optimizer's own
            default (as set in the config's ``optimizer.init_args``). The second group gets 0.
        no_decay_names: name fragments excluded from decay in addition to every 1-D parameter
            (biases, norm weights).

    Returns:
        ``[{"params": decay[, "weight_decay": wd]}, {"params": no_decay, "weight_decay": 0.0}]``,
        empty groups left out.
    """
    fragments = tuple(no_decay_names)
    decay, no_decay = [], []
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim <= 1 or any(f in name for f in fragments):
            no_decay.append(param)
        else:
            decay.append(param)
    decay_group: dict = {"params": decay}
    if weight_decay is not None:
        decay_group["weight_decay"] = weight_decay
    groups = [decay_group, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def warmup_cosine(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float = 0.0,
) -> LambdaLR:
    """Linear warm-up from 0 then half-cycle cosine to ``min_lr_ratio`` x base LR, per step.

    The schedule of open_clip (``cosine_lr``) and MAE (``lr_sched.adjust_learning_rate``), written
    as a ``LambdaLR`` so Lightning steps it and stores its position in checkpoints.

    Args:
        optimizer: optimizer whose groups' ``initial_lr`` / ``lr`` is the peak rate.
        warmup_steps: steps of linear warm-up (0 for none).
        total_steps: total optimizer steps of the run; the cosine ends there.
        min_lr_ratio: final LR as a fraction of the peak.

    Returns:
        The scheduler, to be stepped every optimizer step (``interval: step``).
    """
    if total_steps <= 0 or not math.isfinite(total_steps):
        raise ValueError(
            f"warmup_cosine needs a finite total_steps > 0, got {total_steps}: set trainer.max_steps "
            "or give the data module an epoch length (data.train_num_samples)"
        )
    warmup_steps = max(0, min(int(warmup_steps), int(total_steps) - 1))

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)
