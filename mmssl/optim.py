"""Optimizer helpers shared by every LightningModule: weight-decay groups and the LR schedule.

Which parameters escape weight decay differs between the sources, and each recipe keeps its own
rule (``no_weight_decay`` in the model's init args):

- open_clip (``open_clip_train/main.py``): ``p.ndim < 2 or "bn"/"ln"/"bias"/"logit_scale" in n``,
  so token and positional embeddings are decayed.
- MAE (``main_pretrain.py`` with timm 0.3.2's ``add_weight_decay``, empty skip list): 1-D and
  ``.bias`` only; ``cls_token`` and ``mask_token`` are decayed, ``pos_embed`` is frozen.
- FLIP (``t5x/train_state_initializer.py`` + ``utils/opt_util.py``): biases, norm scales and
  position embeddings only; the cls token and ``logit_scale`` are decayed.
- big_vision / SigLIP (``big_vision/optax.py``, ``wd_mults`` default ``.*/kernel$``): weight
  matrices only; embeddings, norms, biases and the logit scale and bias are not decayed.

The rule is decided from names and from shapes recorded when the model was built (see
:func:`record_shapes`), never from the live tensors: FSDP with ``use_orig_params=True`` hands the
optimizer flattened 1-D shards, so a ``param.ndim`` test there puts every weight in the
no-decay group. timm's ``param_groups_weight_decay`` tests live shapes, hence this module.
"""

from __future__ import annotations

import fnmatch
import math
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from mmssl.upstream import unwrapped_name

# ``no_weight_decay`` entry that stands for "every parameter built with fewer than 2 dimensions"
# (biases, norm gains, scalars such as logit_scale): the shape rule of open_clip, timm and MAE.
NDIM_LT_2 = "ndim<2"


def clean_name(name: str) -> str:
    """A parameter's name with wrapper prefixes removed (``a._fsdp_wrapped_module.b`` -> ``a.b``):
    the name a recipe's ``no_weight_decay`` pattern sees (FSDP 1, activation checkpointing and
    ``torch.compile`` insert them; :func:`mmssl.upstream.unwrapped_name`)."""
    return unwrapped_name(name)


def record_shapes(module: nn.Module) -> dict[str, int]:
    """``{name: ndim}`` of every parameter as built, for :func:`param_groups` after wrapping."""
    return {clean_name(n): p.ndim for n, p in module.named_parameters()}


def unmatched_patterns(patterns: Sequence[str], names: Iterable[str]) -> list[str]:
    """The ``no_weight_decay`` globs that match none of ``names`` (a typo decays silently).

    Not an error: a recipe's list names its own towers' parameters, and stacking a smaller model
    config onto it (``configs/clip/tiny_cpu.yaml``) legitimately leaves some unmatched.
    """
    names = list(names)
    return [p for p in patterns if p != NDIM_LT_2 and not fnmatch.filter(names, p)]


def excluded_from_decay(name: str, ndim: int, patterns: Sequence[str]) -> bool:
    """Whether parameter ``name`` (built with ``ndim`` dims) is in the no-decay group.

    Args:
        name: parameter name without wrapper prefixes.
        ndim: its number of dimensions when the model was built.
        patterns: ``fnmatch`` globs on ``name``, and optionally ``"ndim<2"``.
    """
    if NDIM_LT_2 in patterns and ndim < 2:
        return True
    return any(fnmatch.fnmatchcase(name, p) for p in patterns if p != NDIM_LT_2)


def param_groups(
    module: nn.Module,
    no_weight_decay: Sequence[str] = (NDIM_LT_2,),
    shapes: Optional[Mapping[str, int]] = None,
    weight_decay: float | None = None,
) -> list[dict]:
    """Split trainable parameters into a decayed and a non-decayed group.

    Args:
        module: the model whose ``requires_grad`` parameters are grouped (possibly wrapped).
        no_weight_decay: globs on parameter names (``fnmatch``), plus ``"ndim<2"`` for the shape
            rule; a parameter matching any of them is not decayed.
        shapes: ``{name: ndim}`` recorded before wrapping (:func:`record_shapes`); ``None`` reads
            the live shapes (right only for an unwrapped module).
        weight_decay: decay of the first group; ``None`` leaves it to the optimizer's own
            default (as set in the config's ``optimizer.init_args``). The second group gets 0.

    Returns:
        ``[{"params": decay[, "weight_decay": wd]}, {"params": no_decay, "weight_decay": 0.0}]``,
        empty groups left out.

    Raises:
        KeyError: a parameter whose name is not in ``shapes`` (the model changed after recording).
    """
    decay, no_decay = [], []
    for raw, param in module.named_parameters():
        if not param.requires_grad:
            continue
        name = clean_name(raw)
        if shapes is None:
            ndim = param.ndim
        elif name in shapes:
            ndim = shapes[name]
        else:
            raise KeyError(f"parameter {name!r} was not recorded when the model was built")
        (no_decay if excluded_from_decay(name, ndim, no_weight_decay) else decay).append(param)
    decay_group: dict = {"params": decay}
    if weight_decay is not None:
        decay_group["weight_decay"] = weight_decay
    groups = [decay_group, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _cosine_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _check_total(total_steps: float) -> None:
    if total_steps <= 0 or not math.isfinite(total_steps):
        raise ValueError(
            f"warmup_cosine needs a finite total_steps > 0, got {total_steps}: set trainer.max_steps "
            "or give the data module an epoch length (data.train_num_samples)"
        )


def check_warmup(key: str, value: Optional[float]) -> None:
    """Refuse a negative or non-finite warm-up length (``None``: not set) before training starts.

    Args:
        key: the config key, named in the error (``model.warmup_steps``).
        value: the warm-up in steps or epochs.

    Raises:
        ValueError: ``value`` is below 0, NaN or infinite.
    """
    if value is not None and not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{key} must be a number >= 0 (0: no warm-up), got {value}")


def warmup_cosine(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float = 0.0,
    second_phase: Optional["Phase"] = None,
) -> LambdaLR:
    """Linear warm-up from 0 then half-cycle cosine to ``min_lr_ratio`` x base LR, per step.

    The schedule of open_clip (``cosine_lr``) and MAE (``lr_sched.adjust_learning_rate``), written
    as a ``LambdaLR`` so Lightning steps it and stores its position in checkpoints (a resumed run
    continues mid-phase).

    Args:
        optimizer: optimizer whose groups' ``initial_lr`` / ``lr`` is the peak rate.
        warmup_steps: steps of linear warm-up (0 for none).
        total_steps: total optimizer steps of the run, the second phase included.
        min_lr_ratio: final LR of the first phase as a fraction of its peak.
        second_phase: a last phase with its own warm-up and cosine (FLIP's unmasked tuning):
            its steps are the last ``second_phase.steps`` of ``total_steps``.

    Returns:
        The scheduler, to be stepped every optimizer step (``interval: step``).
    """
    _check_total(total_steps)
    check_warmup("warmup_steps", warmup_steps)
    total_steps = int(total_steps)
    tail = second_phase.steps if second_phase else 0
    first = total_steps - tail
    if first <= 0:
        raise ValueError(f"the second phase ({tail} steps) leaves no steps of the {total_steps} for the first")
    warmup_steps = max(0, min(int(warmup_steps), first - 1))

    def factor(step: int) -> float:
        if step < first or second_phase is None:
            return _cosine_factor(step, warmup_steps, first, min_lr_ratio)
        p = second_phase
        return p.peak_ratio * _cosine_factor(step - first, min(p.warmup_steps, p.steps - 1), p.steps, 0.0)

    return LambdaLR(optimizer, factor)


class Phase:
    """A closing phase of ``steps`` optimizer steps, warm-up then cosine to 0, at
    ``peak_ratio`` x the first phase's peak LR (FLIP's unmasked tuning)."""

    def __init__(self, steps: int, warmup_steps: int, peak_ratio: float) -> None:
        if steps <= 0 or warmup_steps < 0 or peak_ratio < 0:
            raise ValueError(f"bad phase: steps={steps}, warmup_steps={warmup_steps}, peak_ratio={peak_ratio}")
        self.steps, self.warmup_steps, self.peak_ratio = int(steps), int(warmup_steps), float(peak_ratio)


def global_batch_size(trainer: Any, owner: str) -> int:
    """Per-device batch x devices x accumulation: MAE's ``eff_batch_size`` (``main_pretrain.py``,
    ``main_finetune.py``), from the data module's ``batch_size`` or else the training loader's.

    Args:
        trainer: the fitting ``Trainer``.
        owner: the model class, named in the error.

    Raises:
        ValueError: no per-device batch size to read.
    """
    per_device = getattr(trainer.datamodule, "batch_size", None)
    if per_device is None and trainer.train_dataloader is not None:
        per_device = getattr(trainer.train_dataloader, "batch_size", None)
    if per_device is None:
        raise ValueError(f"{owner}(blr=...) needs the per-device batch size from the data module's `batch_size`; "
                         "set model.blr to null and give the optimizer an lr instead")
    return int(per_device) * trainer.world_size * trainer.accumulate_grad_batches


def lr_from_blr(blr: float, trainer: Any, owner: str) -> float:
    """MAE sec. A.1 (``main_pretrain.py`` / ``main_finetune.py``): lr = blr x global batch / 256, logged once."""
    from lightning.pytorch.utilities import rank_zero_info

    batch = global_batch_size(trainer, owner)
    lr = blr * batch / 256
    rank_zero_info(f"{owner}: lr {lr:.3e} = blr {blr:.3e} x global batch {batch} / 256")
    return lr
