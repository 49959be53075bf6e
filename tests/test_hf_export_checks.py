"""``--format hf`` refuses, naming the part, every open_clip tower ``transformers.CLIPModel`` has no
place for (a silent export would load with missing or ignored weights and different outputs).

Each case is a tiny open_clip CLIP with one unrepresentable part, checked in process through
:func:`mmssl.export.hf.check_representable` (``tests/test_export_formats.py`` runs the tool's
refusal end to end, and the round trip of the representable towers).
"""

from __future__ import annotations

import copy

import open_clip
import pytest
import torch
from open_clip.transformer import QuickGELU
from torch import nn

from mmssl.export.hf import NotRepresentable, check_representable, hf_config

VISION = {"image_size": 32, "layers": 2, "width": 32, "head_width": 16, "patch_size": 8}
TEXT = {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2}


def _clip(vision=None, text=None, **kwargs) -> nn.Module:
    torch.manual_seed(0)
    return open_clip.CLIP(embed_dim=24, vision_cfg={**VISION, **(vision or {})}, text_cfg={**TEXT, **(text or {})},
                          **kwargs)


@pytest.fixture(scope="module")
def base():
    return _clip()


def _refused(model: nn.Module) -> str:
    with pytest.raises(NotRepresentable) as err:
        check_representable(model)
    return str(err.value)


def _edited(base: nn.Module, edit) -> nn.Module:
    model = copy.deepcopy(base)
    edit(model)
    return model


@pytest.mark.parametrize("tower, cfg, message", [
    ("vision", {"ls_init_value": 0.1}, "^image tower block 0: layer scale"),
    ("text", {"ls_init_value": 0.1}, "^text tower block 0: layer scale"),
    ("vision", {"scale_fc": True}, r"^image tower block 0: CustomResidualAttentionBlock/Attention \(open_clip's custom block"),
    ("text", {"scale_attn": True}, r"^text tower block 0: CustomResidualAttentionBlock/Attention \(open_clip's custom block"),
    ("vision", {"qk_norm": True}, r"^image tower block 0: CustomResidualAttentionBlock/Attention \(open_clip's custom block"),
])
def test_blocks_clipencoderlayer_cannot_be_are_refused_by_tower_and_block(tower, cfg, message):
    model = _clip(**{tower: cfg})
    assert pytest.raises(NotRepresentable, check_representable, model).match(message)


def test_activations_eps_and_qkv_that_clipmodel_lacks_are_refused_naming_the_block(base):
    check_representable(base)  # the unedited model is representable
    assert hf_config(base)["vision_config"]["hidden_act"] == "gelu"
    assert hf_config(_clip(quick_gelu=True))["text_config"]["hidden_act"] == "quick_gelu"

    def tanh_gelu(m):
        m.transformer.resblocks[1].mlp.gelu = nn.GELU(approximate="tanh")
    message = _refused(_edited(base, tanh_gelu))
    assert message.startswith("text tower block 1: activation GELU(approximate='tanh')")

    def mixed(m):
        m.visual.transformer.resblocks[1].mlp.gelu = QuickGELU()
    assert _refused(_edited(base, mixed)).startswith("image tower: mixed activations {")

    def eps(m):
        m.transformer.resblocks[0].ln_2.eps = 1e-6
    assert _refused(_edited(base, eps)) == ("text tower: mixed activations {'gelu'} or LayerNorm eps "
                                            "{1e-05, 1e-06} across blocks")

    for part in ("in_proj_weight", "in_proj_bias"):
        def no_fused(m, part=part):
            setattr(m.visual.transformer.resblocks[1].attn, part, None)
        assert _refused(_edited(base, no_fused)) == "image tower block 1: attention without a fused biased q/k/v projection"

    def ln_attn(m):
        m.transformer.resblocks[0].ln_attn = nn.LayerNorm(32)
    assert _refused(_edited(base, ln_attn)).startswith("text tower block 0: extra norms")


def test_a_text_tower_that_is_not_open_clips_transformer_is_refused(base):
    custom = open_clip.CustomTextCLIP(embed_dim=24, vision_cfg=VISION, text_cfg=TEXT)
    check_representable(custom)  # CustomTextCLIP with open_clip's TextTransformer: representable

    def foreign(m):
        m.text = nn.Linear(2, 2)
    assert _refused(_edited(custom, foreign)).startswith(
        "the text tower is a Linear (e.g. an HF text model), not open_clip's TextTransformer")
