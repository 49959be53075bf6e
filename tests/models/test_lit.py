"""LiT from an MAE encoder (CLIP model.image_tower_init + lock.image, mmssl.models.lit)."""

from __future__ import annotations

import pytest
import torch

from mmssl.checkpoints.load import load_lightning
from mmssl.models.clip import CLIP
from mmssl.models.mae import MAE
from tests.conftest import REPO

TIMM_CLIP = str(REPO / "configs/models/clip_micro_timm.json")  # timm's test_vit image tower
# An MAE whose encoder has test_vit's sizes (160 px, 16 px patches, width 64, 6 blocks of 2 heads).
TEST_VIT_MAE = dict(image_size=160, patch_size=16, embed_dim=64, depth=6, num_heads=2, mlp_ratio=3.0,
                    decoder_embed_dim=32, decoder_depth=1, decoder_num_heads=2)


def _mae_checkpoint(path, **sizes) -> MAE:
    mae = MAE(**{**TEST_VIT_MAE, **sizes}).eval()
    torch.save({"state_dict": mae.state_dict(), "hyper_parameters": dict(mae.hparams)}, path)
    return mae


def test_lit_tower_is_the_mae_encoder_locked_and_the_text_tower_trains(tmp_path):
    mae = _mae_checkpoint(tmp_path / "mae.ckpt")
    lit = CLIP(model_name=TIMM_CLIP, image_tower_init=str(tmp_path / "mae.ckpt"), lock={"image": True}).eval()
    images = torch.randn(2, 3, 160, 160)
    with torch.no_grad():
        torch.testing.assert_close(lit.model.visual.trunk(images), mae.encoder(images), rtol=0, atol=1e-5)
    assert not any(p.requires_grad for p in lit.model.visual.trunk.parameters())
    assert all(p.requires_grad for p in lit.model.transformer.parameters())
    # A LiT checkpoint holds the tower's weights: loading it reads no MAE file.
    torch.save({"state_dict": lit.state_dict(), "hyper_parameters": dict(lit.hparams)}, tmp_path / "lit.ckpt")
    (tmp_path / "mae.ckpt").unlink()
    with torch.no_grad():
        torch.testing.assert_close(load_lightning(str(tmp_path / "lit.ckpt")).model.visual.trunk(images),
                                   mae.encoder(images))


def test_lit_refuses_an_encoder_of_another_shape_naming_the_key(tmp_path):
    _mae_checkpoint(tmp_path / "wide.ckpt", embed_dim=96, num_heads=2)
    with pytest.raises(ValueError, match=r"model.image_tower_init: .*wide.ckpt: weights of another shape \(cls_token"):
        CLIP(model_name=TIMM_CLIP, image_tower_init=str(tmp_path / "wide.ckpt"))
    with pytest.raises(TypeError, match="needs a timm ViT image tower"):
        CLIP(model_name=str(REPO / "configs/models/clip_micro.json"), image_tower_init=str(tmp_path / "wide.ckpt"))
