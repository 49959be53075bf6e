"""open_clip's tower locking through ``model.lock_*`` (mmssl.models.locking): what stays trainable,
and the settings open_clip would ignore or trip over refused naming the key and the tower."""

from __future__ import annotations

import json

import pytest
from open_clip.utils import FrozenBatchNorm2d

from mmssl.models.clip import CLIP

# open_clip's ModifiedResNet (RN50's shape), tiny: a tower with batch norm and no layer groups.
TINY_RN = {"embed_dim": 32, "vision_cfg": {"image_size": 32, "layers": [1, 1, 1, 1], "width": 8, "head_width": 16},
           "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}


def _trainable(module) -> set[str]:
    return {n for n, p in module.named_parameters() if p.requires_grad}


def test_lock_text_freezes_the_text_tower_and_leaves_the_last_layers(tiny_clip_json):
    model = CLIP(tiny_clip_json, lock={"text": True})
    trainable = _trainable(model.model)
    assert trainable and all(n.startswith("visual.") or n.startswith("logit_") for n in trainable)
    # open_clip's text groups: embeddings, blocks but the last, last block + ln_final, projection.
    last = CLIP(tiny_clip_json, lock={"text": True, "text_unlocked_layers": 1})
    assert _trainable(last.model) - trainable == {"text_projection"}
    two = CLIP(tiny_clip_json, lock={"text": True, "text_unlocked_layers": 2})
    assert {"ln_final.weight", "transformer.resblocks.0.attn.in_proj_weight"} <= _trainable(two.model)
    assert "token_embedding.weight" not in _trainable(two.model)


def test_lock_image_freezes_batch_norm_statistics_of_a_resnet_tower(tmp_path):
    path = tmp_path / "tiny_rn.json"
    path.write_text(json.dumps(TINY_RN))
    model = CLIP(str(path), lock={"image": True, "image_freeze_bn_stats": True})
    assert any(isinstance(m, FrozenBatchNorm2d) for m in model.model.visual.modules())
    assert not any(n.startswith("visual.") for n in _trainable(model.model))
    with pytest.raises(
        ValueError, match="lock.image_unlocked_groups: the image tower ModifiedResNet has no layer groups"
    ):
        CLIP(str(path), lock={"image": True, "image_unlocked_groups": 1})


@pytest.mark.parametrize("kwargs, match", [
    ({"image_unlocked_groups": 2}, "need model.lock.image: true"),
    ({"text_unlocked_layers": 1}, "need model.lock.text: true"),
    ({"image": True, "image_unlocked_groups": 4}, "4 > the 3 groups of the image tower VisionTransformer"),
    ({"text": True, "text_unlocked_layers": 4}, "4 > the 3 layers of the text tower CLIP"),
    ({"image": True, "image_freeze_bn_stats": True}, "image tower VisionTransformer has no batch norm"),
    ({"text": True, "text_freeze_layer_norm": False}, "needs an HF text tower; in the text tower CLIP"),
])
def test_lock_settings_open_clip_cannot_honour_are_refused(tiny_clip_json, kwargs, match):
    with pytest.raises(ValueError, match=match):
        CLIP(tiny_clip_json, lock=kwargs)
