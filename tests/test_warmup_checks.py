"""A negative warm-up is refused when the module is built (before training), naming the key."""

from __future__ import annotations

import pytest
import torch

from mmssl.models import ImageClassifier
from mmssl.models.mae import MAE
from mmssl.optim import warmup_cosine


def test_negative_warmup_is_refused_naming_the_key(tiny_clip_json):
    from mmssl.models.clip import CLIP

    with pytest.raises(ValueError, match="model.warmup_steps must be a number >= 0.*-5"):
        MAE(image_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, decoder_embed_dim=32, decoder_depth=1,
            decoder_num_heads=2, warmup_steps=-5)
    with pytest.raises(ValueError, match="model.warmup_steps must be a number >= 0.*-5"):
        CLIP(tiny_clip_json, warmup_steps=-5)
    tiny_vit = dict(num_classes=2, model_name="vit_tiny_patch16_224", image_size=32,
                    model_kwargs=dict(patch_size=8, embed_dim=32, depth=1, num_heads=2))
    with pytest.raises(ValueError, match="model.warmup_steps must be a number >= 0.*-5"):
        ImageClassifier(**tiny_vit, warmup_steps=-5)
    with pytest.raises(ValueError, match="model.warmup_epochs must be a number >= 0.*nan"):
        ImageClassifier(**tiny_vit, warmup_epochs=float("nan"))
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match="warmup_steps must be a number >= 0"):
        warmup_cosine(optimizer, -5, 100)
