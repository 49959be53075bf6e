"""open_clip's tower locking (LiT, Zhai et al. 2022), checked before anything trains.

``lock_image_tower(unlocked_groups, freeze_bn_stats)`` and ``lock_text_tower(unlocked_layers,
freeze_layer_norm)`` are open_clip's (what ``open_clip_train``'s ``--lock-image*`` /
``--lock-text*`` flags call); this module refuses the settings open_clip would ignore silently or
fail on with a bare ``assert``: groups on a tower locked whole, more groups than the tower has,
norm statistics on a tower without batch norm, unfrozen LayerNorms where they cannot be.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from mmssl.upstream import is_batch_norm


@dataclass(frozen=True)
class LockOptions:
    """``model.init_args.lock``: which towers train (LiT, Zhai et al. 2022; open_clip's ``--lock-*``).

    Attributes:
        image: freeze the image tower, train the text tower only (LiT).
        image_unlocked_groups: with ``image``, leave the last n layer groups trainable (open_clip's
            groups: stem, each block, last block + final norm, projection; a timm tower's
            ``group_matcher``). Refused for a tower locked whole (ResNet) or past its count.
        image_freeze_bn_stats: with ``image``, freeze the batch-norm statistics of the locked
            groups (towers with batch norm only: ResNets, timm CNNs).
        text: freeze the text tower (open_clip ``lock_text_tower``; LiT's other half).
        text_unlocked_layers: with ``text``, leave the last n layers trainable.
        text_freeze_layer_norm: with ``text``, keep LayerNorms frozen too; ``false`` only for HF
            text towers (open_clip's own locks them with the other weights).
    """

    image: bool = False
    image_unlocked_groups: int = 0
    image_freeze_bn_stats: bool = False
    text: bool = False
    text_unlocked_layers: int = 0
    text_freeze_layer_norm: bool = True


# The flat keys of configs and checkpoints written before locking became a config group.
LOCK_RENAMES = {"lock_image": "lock.image", "lock_image_unlocked_groups": "lock.image_unlocked_groups",
                "lock_image_freeze_bn_stats": "lock.image_freeze_bn_stats", "lock_text": "lock.text",
                "lock_text_unlocked_layers": "lock.text_unlocked_layers",
                "lock_text_freeze_layer_norm": "lock.text_freeze_layer_norm"}


def image_groups(visual: nn.Module) -> int:
    """How many layer groups open_clip's ``lock`` can leave unlocked in an image tower (0: none,
    the tower is locked whole)."""
    if type(visual).__name__ == "VisionTransformer":  # open_clip's: stem, blocks, last block + ln_post, proj
        return len(visual.transformer.resblocks) + 2
    trunk = getattr(visual, "trunk", None)
    if trunk is not None and hasattr(trunk, "group_matcher"):
        from timm.models import group_parameters

        return max(group_parameters(trunk, trunk.group_matcher())) + 1
    return 0


def text_groups(model: nn.Module) -> int:
    """How many layers open_clip's ``lock_text_tower`` can leave unlocked (embeddings, blocks,
    last block + final norm, projection), or an HF text tower's (embeddings, layers)."""
    text = getattr(model, "text", model)
    blocks = getattr(getattr(text, "transformer", None), "resblocks", None)
    if blocks is not None:
        return len(blocks) + 1 + (getattr(text, "text_projection", None) is not None)
    if type(text).__name__ == "HFTextEncoder":
        encoder = getattr(text.transformer, "encoder", text.transformer)
        layers = next((m for m in encoder.children() if isinstance(m, nn.ModuleList)), [])
        return len(layers) + 1
    return 0


def _has_batch_norm(module: nn.Module) -> bool:
    return any(is_batch_norm(m) for m in module.modules())


def check_lock_options(model: nn.Module, options: LockOptions) -> None:
    """Raise ``ValueError`` naming the key and the tower for a setting open_clip cannot honour."""
    visual, text = model.visual, getattr(model, "text", model)
    image_name = type(getattr(visual, "trunk", visual)).__name__
    if not options.image and (options.image_unlocked_groups or options.image_freeze_bn_stats):
        raise ValueError("model.lock.image_unlocked_groups / lock.image_freeze_bn_stats need model.lock.image: true")
    if not options.text and (options.text_unlocked_layers or not options.text_freeze_layer_norm):
        raise ValueError("model.lock.text_unlocked_layers / lock.text_freeze_layer_norm need model.lock.text: true")
    if options.image_unlocked_groups < 0 or options.text_unlocked_layers < 0:
        raise ValueError("model.lock.image_unlocked_groups and lock.text_unlocked_layers must be >= 0")
    if options.image_unlocked_groups:
        groups = image_groups(visual)
        if not groups:
            raise ValueError(f"model.lock.image_unlocked_groups: the image tower {image_name} has no layer groups "
                             "(open_clip locks it whole)")
        if options.image_unlocked_groups > groups:
            raise ValueError(f"model.lock.image_unlocked_groups: {options.image_unlocked_groups} > the {groups} "
                             f"groups of the image tower {image_name}")
    if options.image_freeze_bn_stats and not _has_batch_norm(visual):
        raise ValueError(f"model.lock.image_freeze_bn_stats: the image tower {image_name} has no batch norm "
                         "(its LayerNorms have no running statistics)")
    if options.text_unlocked_layers:
        groups = text_groups(model)
        if not groups:
            raise ValueError(
                f"model.lock.text_unlocked_layers: the text tower {type(text).__name__} has no layer groups"
            )
        if options.text_unlocked_layers > groups:
            raise ValueError(f"model.lock.text_unlocked_layers: {options.text_unlocked_layers} > the {groups} "
                             f"layers of the text tower {type(text).__name__}")
    if not options.text_freeze_layer_norm and type(text).__name__ != "HFTextEncoder":
        raise ValueError(f"model.lock.text_freeze_layer_norm: false needs an HF text tower; in the text tower "
                         f"{type(text).__name__} open_clip locks LayerNorms with the other weights")


def lock_towers(model: nn.Module, options: LockOptions) -> None:
    """Check ``options`` (:func:`check_lock_options`), then lock through open_clip.

    Args:
        model: open_clip ``CLIP`` / ``CustomTextCLIP``.
        options: which towers to lock and what to leave trainable.
    """
    check_lock_options(model, options)
    if options.image:
        model.lock_image_tower(unlocked_groups=options.image_unlocked_groups,
                               freeze_bn_stats=options.image_freeze_bn_stats)
    if options.text:
        model.lock_text_tower(unlocked_layers=options.text_unlocked_layers,
                              freeze_layer_norm=options.text_freeze_layer_norm)
