"""LiT from an MAE encoder: a CLIP whose timm image tower starts from an mmssl MAE checkpoint.

LiT (Zhai et al. 2022) locks a pretrained image tower and trains the text tower to read it. Here
the tower is open_clip's ``TimmModel`` (a JSON config with ``vision_cfg.timm_model_name``), its
``trunk`` filled from an mmssl checkpoint of a kind with a ViT (read by
:func:`mmssl.checkpoints.model_file.read_vit_state`, its ViT under timm's names by the table's
converter: an MAE's ``MaskedViT`` uses timm's names), a timm export of one or an MAE release;
``model.lock_image`` then freezes the trunk (open_clip's ``TimmModel.lock``), leaving its linear
projection and the text tower to train.

open_clip builds a timm tower by name only (``TimmModel`` passes no size arguments to
``timm.create_model``), so a ViT of an MAE's own sizes needs a registered timm name: this module
registers the ViTs of mmssl's recipes (importing it, as ``mmssl.models.clip`` does, is enough).
A process that loads an exported LiT model with open_clip alone registers them the same way:
``import mmssl.models.lit``.
"""

from __future__ import annotations

from timm.models import build_model_with_cfg, register_model
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from mmssl.checkpoints.model_file import read_vit_state
from mmssl.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from mmssl.models.vit import load_encoder


def _vit(variant: str, pretrained: bool, image_size: int, **sizes: object) -> VisionTransformer:
    if pretrained:
        raise ValueError(f"timm model {variant!r} is mmssl's and has no pretrained weights to download; "
                         "initialise it from a checkpoint (model.image_tower_init)")
    cfg = {"architecture": variant, "input_size": (3, image_size, image_size), "num_classes": 0,
           "mean": IMAGENET_MEAN, "std": IMAGENET_STD, "first_conv": "patch_embed.proj", "classifier": "head"}
    return build_model_with_cfg(VisionTransformer, variant, pretrained=False, pretrained_cfg=cfg,
                                img_size=image_size, **sizes)


@register_model
def mmssl_vit_micro_patch4_28(pretrained: bool = False, **kwargs: object) -> VisionTransformer:
    """The ViT of configs/fashion_mnist/mae_vit_patch4.yaml: 28x28 images, 4x4 patches, width 128,
    4 blocks of 4 heads, MLP ratio 4 (the MAE's ``MaskedViT`` under timm's names)."""
    sizes = dict(patch_size=4, embed_dim=128, depth=4, num_heads=4, mlp_ratio=4.0)
    kwargs.pop("pretrained_cfg", None)  # timm's factory passes its own (none is registered): ours below
    return _vit("mmssl_vit_micro_patch4_28", pretrained, 28, **{**sizes, **kwargs})


def init_image_tower(model: nn.Module, path: str) -> tuple[list[str], list[str]]:
    """Fill an open_clip model's timm image trunk from a ViT checkpoint (``model.image_tower_init``).

    Args:
        model: the open_clip CLIP, its ``visual`` a ``TimmModel``.
        path: an mmssl MAE / ImageClassifier / CLIP (timm tower) checkpoint or a timm state dict.

    Returns:
        ``(missing, ignored)`` keys (see :func:`mmssl.models.vit.load_encoder`).

    Raises:
        TypeError: the image tower is not a timm model.
        ValueError: a weight of another shape, naming the key; KeyError: a weight the file lacks.
    """
    trunk = getattr(model.visual, "trunk", None)
    if trunk is None or not hasattr(trunk, "patch_embed"):
        raise TypeError(f"model.image_tower_init needs a timm ViT image tower (a model config with "
                        f"vision_cfg.timm_model_name), not open_clip's {type(model.visual).__name__}")
    try:
        return load_encoder(trunk, path, state=read_vit_state(path, "model.image_tower_init"))
    except (KeyError, ValueError) as err:
        raise type(err)(f"model.image_tower_init: {err.args[0]}") from None
