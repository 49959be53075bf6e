"""``model.lora.trainable: []`` trains the adapters alone: an empty list is a choice, not a missing
option that falls back to the model's default trainable parameters (CLIP's logit_scale)."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

from mmssl.models.clip import CLIP  # noqa: E402
from mmssl.models.lora import CLIP_TRAINABLE, clip_towers, inject_lora, parse_lora  # noqa: E402


def test_an_empty_trainable_list_trains_the_adapters_alone(tiny_clip_json):
    spec = parse_lora({"r": 2, "target_modules": "c_fc", "towers": ["text"], "trainable": []}, ["image", "text"])
    assert spec.trainable == ()
    adapters = {"transformer.resblocks.0.mlp.c_fc.lora_A.default.weight",
                "transformer.resblocks.0.mlp.c_fc.lora_B.default.weight"}
    model = CLIP(model_name=tiny_clip_json).model
    inject_lora(model.requires_grad_(False), spec, clip_towers(model), CLIP_TRAINABLE)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == adapters  # not logit_scale
    model = CLIP(model_name=tiny_clip_json).model  # the option left out: the default set as well
    inject_lora(model.requires_grad_(False), parse_lora({"r": 2, "target_modules": "c_fc", "towers": ["text"]},
                                                        ["image", "text"]), clip_towers(model), CLIP_TRAINABLE)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == adapters | {"logit_scale"}
