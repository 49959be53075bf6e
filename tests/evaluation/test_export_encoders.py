"""``load_encoder`` scores export folders as the model they came from: open_clip hub, transformers
``CLIPModel`` and timm hub folders give the checkpoint's own embeddings and image settings."""

from __future__ import annotations

import json

import pytest
import torch

from mmssl.evaluation.encoders import export_format, load_encoder
from mmssl.export.hub import write_open_clip_hf, write_timm_folder
from mmssl.models.clip import CLIP
from mmssl.models.mae import MAE
from tests.conftest import TINY_CLIP


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> CLIP:
    path = tmp_path_factory.mktemp("cfg") / "tiny_enc.json"
    path.write_text(json.dumps(TINY_CLIP))
    torch.manual_seed(0)
    return CLIP(str(path)).eval()


def _same(ours: torch.nn.Module, theirs: torch.nn.Module, text: bool = True) -> None:
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs.encode_image(images), ours.encode_image(images), rtol=0, atol=1e-4)
        if text:
            tokens_ours, tokens_theirs = ours.tokenizer(["a red circle"]), theirs.tokenizer(["a red circle"])
            torch.testing.assert_close(
                theirs.encode_text(tokens_theirs), ours.encode_text(tokens_ours), rtol=0, atol=1e-4
            )
    assert (theirs.image_size, theirs.image_mean, theirs.image_std) == (
        ours.image_size,
        ours.image_mean,
        ours.image_std,
    )


def test_open_clip_hub_folder(clip, tmp_path):
    write_open_clip_hf(clip, str(tmp_path / "oc"))
    assert export_format(str(tmp_path / "oc")) == "open_clip_hf"
    _same(clip, load_encoder(str(tmp_path / "oc")))


def test_transformers_folder(clip, tmp_path):
    pytest.importorskip("transformers")
    from mmssl.export.hf import write_hf

    write_hf(clip, str(tmp_path / "hf"))
    assert export_format(str(tmp_path / "hf")) == "hf"
    theirs = load_encoder(str(tmp_path / "hf"))
    _same(clip, theirs)


def test_timm_folder_and_a_folder_of_nothing(tmp_path):
    torch.manual_seed(0)
    mae = MAE(image_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, decoder_embed_dim=16,
              decoder_depth=1, decoder_num_heads=2).eval()
    write_timm_folder(mae, str(tmp_path / "vit"))
    assert export_format(str(tmp_path / "vit")) == "timm"
    _same(mae, load_encoder(str(tmp_path / "vit")), text=False)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="not an export folder"):
        load_encoder(str(tmp_path / "other"))
