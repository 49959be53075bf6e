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

Layer-wise LR decay in pretraining, per tower (open_clip main; BEiT / MAE ``util/lr_decay.py``
numbering), and Muon-family optimizers (``timm.optim.Muon``: Muon, and with ``algo: adamuon`` /
``nesterov: true`` AdaMuon and NAdaMuon) are two more keys on the same groups: each group carries
an ``lr_scale`` and, for a Muon optimizer, timm's ``use_fallback`` flag (:func:`param_groups`,
:func:`build_optimizer`).
"""

from __future__ import annotations

import fnmatch
import math
import re
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from mmssl.errors import ConfigError
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


# A transformer block's parameters: open_clip's ``transformer.resblocks.N`` (and a CoCa decoder's
# ``cross_attn.N``), timm's and MAE's ``blocks.N``, Hugging Face's ``layer.N``: the unit of layer-wise
# decay and where Muon's hidden matrices live.
BLOCK = re.compile(r"\.(?:resblocks|blocks|layers?|cross_attn)\.(\d+)\.")
# A tower's parameters before its first block (layer 0): patch / token / position embeddings, the
# class and register tokens (CoCa's ``cls_emb``), the pre-norm. Any other parameter outside the
# blocks (final norm, projection, pooler, head) is the tower's top layer. MAE util/lr_decay.py
# ``get_layer_id_for_vit``.
STEM = ("*embed*", "*cls_emb", "*conv1.*", "*ln_pre.*", "*cls_token", "*reg_token", "*norm_pre.*",
        "*patchnorm_pre_ln.*", "*image_type", "*text_type")  # the last two: M3AE's modality embeddings


def tower_depth(names: Iterable[str]) -> int:
    """The number of numbered blocks among ``names`` (1 + the highest block index; 0: none)."""
    ids = [int(m.group(1)) for m in map(BLOCK.search, names) if m]
    return max(ids) + 1 if ids else 0


def layer_id(name: str, depth: int) -> int:
    """A tower parameter's layer: 0 for the stem, N + 1 for block N, ``depth + 1`` for the rest."""
    match = BLOCK.search(name)
    if match:
        return int(match.group(1)) + 1
    return 0 if any(fnmatch.fnmatchcase(name, p) for p in STEM) else depth + 1


def check_layer_decay(key: str, value: Union[float, Mapping[str, float], None],
                      towers: Sequence[str]) -> dict[str, float]:
    """``{tower: decay}`` from a config's ``layer_decay`` (a float: every tower; ``None``: none).

    Raises:
        ConfigError: a tower that is not one of ``towers``, or a decay outside (0, 1].
    """
    if value is None:
        return {}
    decays = dict(value) if isinstance(value, Mapping) else {t: value for t in towers}
    for tower, decay in decays.items():
        if tower not in towers:
            raise ConfigError(f"{key}.{tower}: not a tower of this model (towers: {', '.join(towers)})")
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 < decay <= 1.0:
            raise ConfigError(f"{key}.{tower} must be in (0, 1], got {decay!r}")
    return {t: float(d) for t, d in decays.items()}


def layer_scales(names: Iterable[str], towers: Mapping[str, Sequence[str]], decays: Mapping[str, float],
                 key: str = "model.init_args.layer_decay") -> dict[str, float]:
    """Each parameter's LR multiplier: ``decay ** (depth + 1 - layer_id)`` within its tower.

    Each tower counts its blocks from its own depth (open_clip main's per-tower decay), so the
    image tower's last block and the text tower's last block both get ``decay``, their stems
    ``decay ** (depth + 1)``, and their final norm and projection 1. A parameter in no tower, or
    in a tower without a decay (the logit scale, a decoder), keeps 1.

    Written here rather than with timm's ``param_groups_layer_decay``: that needs a
    ``group_matcher`` on one module, which open_clip's towers lack and which has no notion of two
    towers in one model, and it tests the live ``param.ndim`` (see the module docstring).

    Args:
        names: parameter names without wrapper prefixes.
        towers: tower -> ``fnmatch`` globs of its parameter names (first tower matching wins).
        decays: tower -> layer decay in (0, 1] (:func:`check_layer_decay`).
        key: the config key, named in the error.

    Raises:
        ConfigError: a tower with a decay below 1 but no numbered blocks.
    """
    names = list(names)
    members: dict[str, list[str]] = {t: [] for t in towers}
    for name in names:
        tower = next((t for t, globs in towers.items() if any(fnmatch.fnmatchcase(name, g) for g in globs)), None)
        if tower is not None:
            members[tower].append(name)
    scales = dict.fromkeys(names, 1.0)
    for tower, decay in decays.items():
        depth = tower_depth(members[tower])
        if depth == 0 and decay != 1.0:
            raise ConfigError(f"{key}.{tower}: the {tower} tower has no numbered blocks to decay")
        for name in members[tower]:
            scales[name] = decay ** (depth + 1 - layer_id(name, depth))
    return scales


def muon_takes(name: str, ndim: int) -> bool:
    """Whether a Muon-family optimizer updates parameter ``name`` (built with ``ndim`` dims).

    Muon orthogonalises the update of a hidden weight matrix: a 2-D (or conv, flattened) weight
    inside a transformer block. Everything else goes to the AdamW fallback, as Keller Jordan's Muon
    README, timm's ``Muon`` and open_clip main route them: patch, token and position embeddings
    (a lookup table or the input layer), class tokens, norms and biases, the logit scale and bias,
    and each tower's projection or head (the output layer).
    """
    return ndim >= 2 and BLOCK.search(name) is not None


def param_groups(
    module: nn.Module,
    no_weight_decay: Sequence[str] = (NDIM_LT_2,),
    shapes: Optional[Mapping[str, int]] = None,
    weight_decay: float | None = None,
    lr_scales: Optional[Mapping[str, float]] = None,
    hybrid: bool = False,
) -> list[dict]:
    """Split trainable parameters into decayed and non-decayed groups (per LR scale and router).

    Args:
        module: the model whose ``requires_grad`` parameters are grouped (possibly wrapped).
        no_weight_decay: globs on parameter names (``fnmatch``), plus ``"ndim<2"`` for the shape
            rule; a parameter matching any of them is not decayed.
        shapes: ``{name: ndim}`` recorded before wrapping (:func:`record_shapes`); ``None`` reads
            the live shapes (right only for an unwrapped module).
        weight_decay: decay of the decayed groups; ``None`` leaves it to the optimizer's own
            default (as set in the config's ``optimizer.init_args``). The others get 0.
        lr_scales: ``{name: multiplier}`` (:func:`layer_scales`); each group gets its ``lr_scale``.
        hybrid: also split by :func:`muon_takes`; the other groups get ``use_fallback: True``.

    Returns:
        Without ``lr_scales`` and ``hybrid``: ``[{"params": decay[, "weight_decay": wd]},
        {"params": no_decay, "weight_decay": 0.0}]``; with them, one such pair per LR scale (highest
        first) and router. Empty groups left out.

    Raises:
        KeyError: a parameter whose name is not in ``shapes`` (the model changed after recording).
    """
    groups: dict[tuple[float, bool, bool], list] = {}
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
        scale = 1.0 if lr_scales is None else lr_scales[name]
        fallback = hybrid and not muon_takes(name, ndim)
        key = (-scale, fallback, excluded_from_decay(name, ndim, no_weight_decay))
        groups.setdefault(key, []).append(param)
    out = []
    for (neg_scale, fallback, no_decay), params in sorted(groups.items(), key=lambda kv: kv[0]):
        group: dict = {"params": params}
        if no_decay:
            group["weight_decay"] = 0.0
        elif weight_decay is not None:
            group["weight_decay"] = weight_decay
        if lr_scales is not None:
            group["lr_scale"] = -neg_scale
        if fallback:
            group["use_fallback"] = True
        out.append(group)
    return out


def is_hybrid(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` routes groups flagged ``use_fallback`` to AdamW (timm's Muon family)."""
    from timm.optim import Muon

    return isinstance(optimizer, Muon)


def build_optimizer(
    factory: Callable[[list[dict]], torch.optim.Optimizer],
    module: nn.Module,
    no_weight_decay: Sequence[str],
    shapes: Mapping[str, int],
    lr_scales: Optional[Mapping[str, float]] = None,
    lr: Optional[float] = None,
) -> torch.optim.Optimizer:
    """The recipe's optimizer over :func:`param_groups`, each group's peak LR scaled by its tower layer.

    The factory is called once with the groups split for a Muon-family optimizer; if what it built
    is not one (``torch.optim.AdamW``, SGD, ...), it is built again from the plain groups, so an
    AdamW run keeps the groups, and the checkpoints, it had before Muon existed.

    Args:
        factory: the config's ``optimizer`` (Lightning's ``OptimizerCallable``).
        module, no_weight_decay, shapes: as :func:`param_groups`.
        lr_scales: ``{name: multiplier}``; ``None``: every group at the peak LR.
        lr: the peak LR (MAE's ``blr`` rule); ``None``: the optimizer's own ``lr``.

    Returns:
        The optimizer, each group's ``lr`` (and ``initial_lr``, which ``warmup_cosine``'s
        ``LambdaLR`` multiplies by its factor) set to peak x ``lr_scale``.
    """
    optimizer = factory(param_groups(module, no_weight_decay, shapes, lr_scales=lr_scales, hybrid=True))
    if not is_hybrid(optimizer):
        optimizer = factory(param_groups(module, no_weight_decay, shapes, lr_scales=lr_scales))
    for group in optimizer.param_groups:
        peak = (group["lr"] if lr is None else lr) * group.get("lr_scale", 1.0)
        group["lr"] = group["initial_lr"] = peak
    return optimizer


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
