import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch

from mmssl.export import export_checkpoint
from mmssl.models.mae import MAE

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(image_size=32, patch_size=4, embed_dim=64, depth=2, num_heads=4,
            decoder_embed_dim=32, decoder_depth=1, decoder_num_heads=4)


def timm_tiny():
    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, num_classes=0, global_pool="token",
        img_size=32, patch_size=4, embed_dim=64, depth=2, num_heads=4,
    ).eval()


def write_ckpt(path):
    model = MAE(**TINY).eval()
    # Perturb the weights so the round trip cannot pass on shared initialisation.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams)}, path)
    return model


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_timm_round_trip(tmp_path, suffix):
    model = write_ckpt(tmp_path / "mae.ckpt")
    out = tmp_path / f"vit{suffix}"
    subprocess.run(
        [sys.executable, str(ROOT / "tools/export.py"), "--ckpt", str(tmp_path / "mae.ckpt"),
         "--format", "timm", "--output", str(out)],
        check=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": ""},
    )
    if suffix == ".safetensors":
        from safetensors.torch import load_file
        state = load_file(out)
    else:
        state = torch.load(out, weights_only=True)
    vit = timm_tiny()
    result = vit.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(vit(images), model.encode_image(images), rtol=0, atol=1e-6)
        torch.testing.assert_close(vit.forward_features(images), model.forward_features(images), rtol=0, atol=1e-6)


def test_init_encoder_from_timm_file(tmp_path):
    vit = timm_tiny()
    torch.save(vit.state_dict(), tmp_path / "timm.pth")
    model = MAE(**TINY, init_encoder=str(tmp_path / "timm.pth")).eval()
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model.encode_image(images), vit(images))


def test_unknown_format(tmp_path):
    write_ckpt(tmp_path / "mae.ckpt")
    with pytest.raises(ValueError, match="unknown export format"):
        export_checkpoint(str(tmp_path / "mae.ckpt"), "onnx", str(tmp_path / "x.pth"))


def test_init_from_mae_release_with_decoder_continues_pretraining(tmp_path):
    # MAE's mae_visualize_* layout: encoder under timm names, decoder under decoder_* names.
    src = MAE(**TINY).eval()
    names = {"embed.": "decoder_embed.", "mask_token": "mask_token",
             "pos_embed": "decoder_pos_embed", "blocks.": "decoder_blocks.",
             "norm.": "decoder_norm.", "pred.": "decoder_pred."}
    release = {k.removeprefix("encoder."): v for k, v in src.state_dict().items()
               if k.startswith("encoder.")}
    for key, value in src.decoder.state_dict().items():
        prefix = next(p for p in names if key.startswith(p))
        release[names[prefix] + key[len(prefix):]] = value
    torch.save({"model": release}, tmp_path / "mae_visualize.pth")
    model = MAE(**TINY, init_encoder=str(tmp_path / "mae_visualize.pth")).eval()
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ours = model(images, torch.Generator().manual_seed(0))[1]
        theirs = src(images, torch.Generator().manual_seed(0))[1]
    torch.testing.assert_close(ours, theirs)
