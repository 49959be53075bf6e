"""``--format hf`` in process: it refuses, naming the part, every open_clip tower
``transformers.CLIPModel`` has no place for (a silent export would load with missing or ignored
weights and different outputs), and the config it writes states the model's own values.

Each refusal case is a tiny open_clip CLIP with one unrepresentable part, checked through
:func:`mmssl.export.hf.check_representable` (``tests/export/test_export_formats.py`` runs the tool's
refusal end to end, and the round trip of the default towers through ``from_pretrained``).
"""

from __future__ import annotations

import copy

import open_clip
import pytest
import torch
from open_clip.transformer import QuickGELU
from torch import nn

from mmssl.export.hf import NotRepresentable, check_representable, hf_config, hf_state_dict

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


@pytest.mark.parametrize(
    "tower, cfg, message",
    [
        ("vision", {"ls_init_value": 0.1}, "^image tower block 0: layer scale"),
        ("text", {"ls_init_value": 0.1}, "^text tower block 0: layer scale"),
        (
            "vision",
            {"scale_fc": True},
            r"^image tower block 0: CustomResidualAttentionBlock/Attention \(open_clip's custom block",
        ),
        (
            "text",
            {"scale_attn": True},
            r"^text tower block 0: CustomResidualAttentionBlock/Attention \(open_clip's custom block",
        ),
        (
            "vision",
            {"qk_norm": True},
            r"^image tower block 0: CustomResidualAttentionBlock/Attention \(open_clip's custom block",
        ),
    ],
)
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

        assert (
            _refused(_edited(base, no_fused))
            == "image tower block 1: attention without a fused biased q/k/v projection"
        )

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


def test_image_towers_clipmodel_cannot_hold_are_refused_with_the_reason(base):
    def timm_tower(m):
        m.visual = nn.Identity()
    assert _refused(_edited(base, timm_tower)) == (
        "the image tower is a Identity (a timm or ResNet tower), not open_clip's VisionTransformer; "
        "export it with --format open_clip_hf (or --format open_clip) instead")
    assert _refused(_clip({"no_ln_pre": True})) == (
        "image tower without ln_pre or with a patch-embedding bias (CLIPModel has a pre-norm, no bias)")

    def conv_bias(m):
        m.visual.conv1.bias = nn.Parameter(torch.zeros(32))
    assert _refused(_edited(base, conv_bias)).startswith("image tower without ln_pre or with a patch-embedding bias")
    projection = "or an image projection that is not a plain matrix"
    assert _refused(_clip({"image_size": (32, 48)})) == f"non-square images (32, 48) {projection}"

    def no_proj(m):
        m.visual.proj = None
    assert _refused(_edited(base, no_proj)) == f"non-square images (32, 32) {projection}"

    def tensor_proj(m):
        proj = m.visual.proj.detach()
        del m.visual.proj
        m.visual.register_buffer("proj", proj)
    assert _refused(_edited(base, tensor_proj)) == f"non-square images (32, 32) {projection}"
    check_representable(_clip({"image_size": (32, 32)}))  # a square tuple is a square image


def test_the_config_states_the_models_values_not_transformers_defaults():
    eps = {"norm_kwargs": {"eps": 1e-6}}  # not CLIPConfig's default 1e-5
    model = _clip({**eps, "patch_size": 4, "mlp_ratio": 2.0}, {**eps, "context_length": 12, "mlp_ratio": 3.0})
    with torch.no_grad():
        model.logit_scale.fill_(3.0)
    assert hf_config(model) == {
        "projection_dim": 24, "logit_scale_init_value": 3.0,
        "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                          "image_size": 32, "patch_size": 4, "num_channels": 3, "hidden_act": "gelu",
                          "layer_norm_eps": 1e-6, "projection_dim": 24},
        "text_config": {"vocab_size": 49408, "hidden_size": 32, "intermediate_size": 96, "num_hidden_layers": 2,
                        "num_attention_heads": 2, "max_position_embeddings": 12, "hidden_act": "gelu",
                        "layer_norm_eps": 1e-6, "projection_dim": 24,
                        "bos_token_id": 49406, "eos_token_id": 49407, "pad_token_id": 49407},
    }


def test_a_linear_text_projection_and_tuple_image_size_load_into_clipmodel_with_equal_outputs():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    biased = open_clip.CustomTextCLIP(embed_dim=24, vision_cfg=VISION, text_cfg={**TEXT, "proj_bias": True})
    assert _refused(biased) == "text projection with a bias (CLIPModel's has none)"
    model = open_clip.CustomTextCLIP(embed_dim=24, vision_cfg={**VISION, "image_size": (32, 32)}, text_cfg=TEXT).eval()
    del model.text.text_projection  # open_clip builds a Linear only with a bias; by hand here
    model.text.text_projection = nn.Linear(32, 24, bias=False)
    config = hf_config(model)
    assert config["vision_config"]["image_size"] == 32
    hf = transformers.CLIPModel(transformers.CLIPConfig(**config)).eval()
    hf.load_state_dict(hf_state_dict(model), strict=True)
    tokens = torch.tensor([[49406, 320, 1929, 49407] + [0] * 12])
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        text = hf.get_text_features(input_ids=tokens, attention_mask=(tokens > 0).long())
        image = hf.get_image_features(pixel_values=images)
        text, image = (getattr(x, "pooler_output", x) for x in (text, image))  # transformers 5: an output object
        torch.testing.assert_close(text, model.encode_text(tokens), rtol=0, atol=1e-5)
        torch.testing.assert_close(image, model.encode_image(images), rtol=0, atol=1e-5)


@pytest.mark.parametrize("text, pool", [({"no_causal_mask": True}, "argmax"), ({"pool_type": "last"}, "last"),
                                        ({"embed_cls": True, "pool_type": "last"}, "last")])
def test_text_towers_cliptextmodel_cannot_hold_are_refused_with_the_pooling(text, pool):
    assert _refused(_clip(text=text)) == (
        f"text tower without the causal mask, with a class token or pooled by {pool!r}: "
        "CLIPTextModel is causal and pools the end-of-text token"
    )


def test_a_text_vocabulary_other_than_open_clips_bpe_is_refused():
    assert _refused(_clip(text={"vocab_size": 1000})) == (
        "text vocabulary of 1000 tokens: the tokenizer files are open_clip's BPE vocabulary of 49408")
    custom = open_clip.CustomTextCLIP(embed_dim=24, vision_cfg=VISION, text_cfg={**TEXT, "embed_cls": True})
    assert _refused(custom).startswith("text tower without the causal mask, with a class token")
