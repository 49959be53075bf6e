"""Per-tower layer decay and Muon routing (mmssl.optim): the groups of a constructed model whose
every LR multiplier and router is worked out by hand, the real CLIP and MAE, and the errors."""

from __future__ import annotations

import functools

import pytest
import torch
from timm.optim import Muon
from torch import nn

from mmssl.errors import ConfigError
from mmssl.models.clip import CLIP, CLIP_TOWERS
from mmssl.models.mae import MAE, MAE_TOWERS
from mmssl.optim import NDIM_LT_2, build_optimizer, layer_scales, param_groups, record_shapes, warmup_cosine
from tests.tiny import tiny_mae

# An open_clip CLIP's layout in miniature, as the LightningModule names it: image tower of depth 2,
# text tower of depth 1, and the logit scale in neither.
SHAPES = {
    "model.visual.conv1.weight": (8, 3, 2, 2),
    "model.visual.class_embedding": (8,),
    "model.visual.positional_embedding": (5, 8),
    "model.visual.transformer.resblocks.0.mlp.c_fc.weight": (16, 8),
    "model.visual.transformer.resblocks.0.mlp.c_fc.bias": (16,),
    "model.visual.transformer.resblocks.1.mlp.c_fc.weight": (16, 8),
    "model.visual.ln_post.weight": (8,),
    "model.visual.proj": (8, 4),
    "model.token_embedding.weight": (10, 8),
    "model.positional_embedding": (6, 8),
    "model.transformer.resblocks.0.attn.in_proj_weight": (24, 8),
    "model.ln_final.weight": (8,),
    "model.text_projection": (8, 4),
    "model.logit_scale": (),
}
# By hand, image decay 0.5 over depth 2 (stem 0.5^3, block N 0.5^(2-N), top 1) and text decay 0.8
# over depth 1 (stem 0.8^2, block 0 0.8, top 1).
SCALES = {
    "model.visual.conv1.weight": 0.125, "model.visual.class_embedding": 0.125,
    "model.visual.positional_embedding": 0.125,
    "model.visual.transformer.resblocks.0.mlp.c_fc.weight": 0.25,
    "model.visual.transformer.resblocks.0.mlp.c_fc.bias": 0.25,
    "model.visual.transformer.resblocks.1.mlp.c_fc.weight": 0.5,
    "model.visual.ln_post.weight": 1.0, "model.visual.proj": 1.0,
    "model.token_embedding.weight": 0.64, "model.positional_embedding": 0.64,
    "model.transformer.resblocks.0.attn.in_proj_weight": 0.8,
    "model.ln_final.weight": 1.0, "model.text_projection": 1.0, "model.logit_scale": 1.0,
}
# Muon takes the blocks' weight matrices only; the rest goes to its AdamW fallback.
MUON = {"model.visual.transformer.resblocks.0.mlp.c_fc.weight", "model.visual.transformer.resblocks.1.mlp.c_fc.weight",
        "model.transformer.resblocks.0.attn.in_proj_weight"}


def _model() -> nn.Module:
    root = nn.Module()
    for name, shape in SHAPES.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, nn.Parameter(torch.randn(shape)))
    return root


def _by_name(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict]:
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    return {n: group_of[id(p)] for n, p in module.named_parameters()}


def test_layer_scales_per_tower_by_hand():
    assert layer_scales(SHAPES, CLIP_TOWERS, {"image": 0.5, "text": 0.8}) == pytest.approx(SCALES)
    # Only the image tower decayed: the text tower stays at 1.
    only_image = layer_scales(SHAPES, CLIP_TOWERS, {"image": 0.5})
    assert only_image["model.token_embedding.weight"] == 1.0 and only_image["model.visual.proj"] == 1.0


def test_muon_groups_lrs_and_routing_by_hand():
    model = _model()
    shapes = record_shapes(model)
    scales = layer_scales(shapes, CLIP_TOWERS, {"image": 0.5, "text": 0.8})
    muon = functools.partial(Muon, lr=0.1, weight_decay=0.2, fallback_lr_scale=0.01)
    optimizer = build_optimizer(muon, model, [NDIM_LT_2], shapes, scales)
    groups = _by_name(model, optimizer)
    for name, group in groups.items():
        assert group["lr"] == group["initial_lr"] == pytest.approx(0.1 * SCALES[name]), name
        assert group.get("use_fallback", False) == (name not in MUON), name
        assert group["weight_decay"] == (0.0 if len(SHAPES[name]) < 2 else 0.2), name
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    routed = {n: optimizer.state[p]["use_muon"] for n, p in model.named_parameters()}
    assert {n for n, m in routed.items() if m} == MUON
    params = dict(model.named_parameters())
    assert "exp_avg" in optimizer.state[params["model.visual.proj"]]  # the head: AdamW's moments
    assert "momentum_buffer" in optimizer.state[params["model.transformer.resblocks.0.attn.in_proj_weight"]]



def test_schedule_multiplies_each_groups_own_peak():
    model = _model()
    shapes = record_shapes(model)
    scales = layer_scales(shapes, CLIP_TOWERS, {"image": 0.5, "text": 0.8})
    optimizer = build_optimizer(functools.partial(torch.optim.AdamW, lr=1e-2), model, [NDIM_LT_2], shapes, scales)
    assert not any("use_fallback" in g for g in optimizer.param_groups)  # not a Muon: no router split
    scheduler = warmup_cosine(optimizer, warmup_steps=2, total_steps=10)
    for _ in range(5):
        optimizer.step()
        scheduler.step()
    factor = scheduler.lr_lambdas[0](5)
    for group in optimizer.param_groups:
        assert group["lr"] == pytest.approx(1e-2 * group["lr_scale"] * factor)


def test_without_layer_decay_adamw_keeps_its_two_groups():
    model = _model()
    shapes = record_shapes(model)
    optimizer = build_optimizer(functools.partial(torch.optim.AdamW, lr=1e-3), model, [NDIM_LT_2], shapes)
    plain = param_groups(model, [NDIM_LT_2], shapes)
    assert len(optimizer.param_groups) == len(plain) == 2
    for built, expected in zip(optimizer.param_groups, plain):
        assert built["params"] == expected["params"] and built["lr"] == 1e-3


def test_real_clip_towers(tiny_clip_json):
    model = CLIP(model_name=tiny_clip_json, layer_decay={"image": 0.5, "text": 0.8})
    scales = model._lr_scales
    depth = 1 + max(int(n.split("resblocks.")[1].split(".")[0]) for n in scales if "visual.transformer.resblocks" in n)
    assert scales["model.visual.conv1.weight"] == pytest.approx(0.5 ** (depth + 1))
    assert scales["model.visual.ln_pre.weight"] == pytest.approx(0.5 ** (depth + 1))  # the pre-norm: stem
    assert scales[f"model.visual.transformer.resblocks.{depth - 1}.mlp.c_fc.weight"] == pytest.approx(0.5)
    assert scales["model.token_embedding.weight"] < 1 and scales["model.text_projection"] == 1.0
    assert scales["model.logit_scale"] == 1.0 and set(scales) == set(model._param_ndim)


def test_mae_decays_the_encoder_only():
    scales = MAE(**tiny_mae(depth=2), layer_decay=0.5)._lr_scales
    assert scales["encoder.cls_token"] == scales["encoder.patch_embed.proj.weight"] == pytest.approx(0.125)
    assert scales["encoder.blocks.0.attn.qkv.weight"] == pytest.approx(0.25)
    assert scales["encoder.blocks.1.attn.qkv.weight"] == pytest.approx(0.5)
    assert scales["encoder.norm.weight"] == 1.0
    assert all(s == 1.0 for n, s in scales.items() if n.startswith("decoder."))
    assert set(MAE_TOWERS) == {"encoder"}


@pytest.mark.parametrize("value, message", [
    ({"image": 1.5}, "model.init_args.layer_decay.image must be in (0, 1], got 1.5"),
    ({"text": 0.0}, "model.init_args.layer_decay.text must be in (0, 1], got 0.0"),
    (-0.1, "model.init_args.layer_decay.image must be in (0, 1], got -0.1"),
    ({"audio": 0.5}, "model.init_args.layer_decay.audio: not a tower of this model (towers: image, text)"),
])
def test_bad_layer_decay_fails_at_start_up_naming_the_key(tiny_clip_json, value, message):
    with pytest.raises(ConfigError) as error:
        CLIP(model_name=tiny_clip_json, layer_decay=value)
    assert str(error.value) == message


def test_coca_decoder_blocks_go_to_muon_and_its_projection_to_adamw(tiny_coca_json):
    from mmssl.optim import muon_takes

    model = CLIP(model_name=tiny_coca_json, loss="siglip", objectives={"caption": {}}, layer_decay=0.5)
    decoder = {n: muon_takes(n, d) for n, d in model._param_ndim.items() if n.startswith("model.text_decoder.")}
    assert decoder["model.text_decoder.cross_attn.0.attn.in_proj_weight"]
    assert decoder["model.text_decoder.resblocks.0.mlp.c_fc.weight"]
    assert not decoder["model.text_decoder.text_projection"]
    assert all(model._lr_scales[n] == 1.0 for n in decoder)  # in no tower: not decayed
    # CoCa's text class token (cls_emb) is the text tower's stem: 0.5 ** (depth 1 + 1).
    assert model._lr_scales["model.text.cls_emb"] == pytest.approx(0.25)


def test_layer_decay_bounds_and_types():
    from mmssl.optim import check_layer_decay

    # 1 is in (0, 1] (no decay), and a float applies to every tower.
    assert check_layer_decay("k", 1.0, ("image", "text")) == {"image": 1.0, "text": 1.0}
    assert check_layer_decay("k", {"text": 0.5}, ("image", "text")) == {"text": 0.5}
    assert check_layer_decay("k", None, ("image", "text")) == {}
    # A YAML `true` is not the number 1.
    with pytest.raises(ConfigError, match=r"k\.image must be in \(0, 1\], got True"):
        check_layer_decay("k", True, ("image", "text"))


def test_decaying_a_tower_without_blocks_fails_naming_it():
    towers = {"image": ["model.visual.*"], "head": ["model.text_projection"]}
    with pytest.raises(ConfigError, match=r"^key\.head: the head tower has no numbered blocks to decay$"):
        layer_scales(SHAPES, towers, {"image": 0.5, "head": 0.5}, key="key")
    # A decay of 1 there is harmless: every scale stays 1.
    assert layer_scales(SHAPES, towers, {"head": 1.0})["model.text_projection"] == 1.0


def test_explicit_peak_lr_overrides_the_optimizers_own():
    model = _model()
    shapes = record_shapes(model)
    scales = layer_scales(shapes, CLIP_TOWERS, {"image": 0.5, "text": 0.8})
    optimizer = build_optimizer(functools.partial(torch.optim.AdamW, lr=1.0), model, [NDIM_LT_2], shapes, scales,
                                lr=0.04)
    for name, group in _by_name(model, optimizer).items():
        assert group["lr"] == group["initial_lr"] == pytest.approx(0.04 * SCALES[name]), name


def test_muon_routing_reads_recorded_shapes_not_flattened_shards():
    # FSDP (use_orig_params) hands the optimizer flat 1-D shards: routing must follow the shapes as built.
    model = _model()
    shapes = record_shapes(model)
    for name, param in list(model.named_parameters()):
        *path, leaf = name.split(".")
        owner = model.get_submodule(".".join(path))
        setattr(owner, leaf, nn.Parameter(param.detach().flatten()))
    groups = param_groups(model, [NDIM_LT_2], shapes, hybrid=True)
    group_of = {id(p): g for g in groups for p in g["params"]}
    muon = {n for n, p in model.named_parameters() if not group_of[id(p)].get("use_fallback", False)}
    assert muon == MUON


def test_group_order_decayed_first_then_highest_scale_first():
    # The first parameter is a norm gain (no decay), yet the decayed group still comes first: the
    # order of the groups before layer decay existed, which a resumed AdamW checkpoint's groups follow.
    model = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4))
    shapes = record_shapes(model)
    plain = param_groups(model, [NDIM_LT_2], shapes)
    assert [g.get("weight_decay") for g in plain] == [None, 0.0]
    assert plain[0]["params"] == [model[1].weight]
    scaled = param_groups(model, [NDIM_LT_2], shapes, lr_scales={"0.weight": 0.5, "0.bias": 0.5,
                                                                   "1.weight": 1.0, "1.bias": 0.25})
    assert [(g["lr_scale"], g.get("weight_decay")) for g in scaled] == [(1.0, None), (0.5, 0.0), (0.25, 0.0)]


def test_without_the_shape_rule_only_the_patterns_escape_decay():
    model = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4))
    groups = param_groups(model, ["*bias"], record_shapes(model))
    assert groups[0]["params"] == [model[0].weight, model[1].weight]  # the 1-D norm gain decayed
    assert groups[1]["params"] == [model[0].bias, model[1].bias] and groups[1]["weight_decay"] == 0.0


def test_m3ae_decays_its_shared_encoder_and_its_stem_with_it():
    from mmssl.models.m3ae import M3AE, M3AE_TOWERS

    tiny = dict(image_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, decoder_embed_dim=32,
                decoder_depth=1, decoder_num_heads=2, text_length=16)
    model = M3AE(**tiny, layer_decay=0.5)
    scales = model._lr_scales
    # stem: D + 1 = 3 steps of decay; block N of 2: 2 - N; the encoder's final norm and the decoder: 1
    for stem in ("encoder.cls_token", "encoder.patch_embed.proj.weight", "token_embed.weight", "image_type",
                 "text_type"):
        assert scales[stem] == pytest.approx(0.125), stem
    assert scales["encoder.blocks.0.attn.qkv.weight"] == pytest.approx(0.25)
    assert scales["encoder.blocks.1.mlp.fc2.weight"] == pytest.approx(0.5)
    assert scales["encoder.norm.weight"] == 1.0
    assert all(s == 1.0 for n, s in scales.items() if n.startswith(("mm_decoder.", "decoder_", "text_pred.")))
    assert set(M3AE_TOWERS) == {"encoder"} and M3AE(**tiny)._lr_scales is None  # off by default: two groups
    # MAE's configure_optimizers (M3AE borrows it) puts each scale into its group's lr
    groups = build_optimizer(functools.partial(torch.optim.AdamW, lr=1e-3), model, model.no_weight_decay,
                             model._param_ndim, scales).param_groups
    by_name = {id(p): n for n, p in model.named_parameters()}
    for group in groups:
        for p in group["params"]:
            assert group["lr"] == pytest.approx(1e-3 * scales[by_name[id(p)]])
    with pytest.raises(ConfigError, match=r"model.init_args.layer_decay.encoder must be in \(0, 1\], got 1.5"):
        M3AE(**tiny, layer_decay=1.5)
