"""``tools/export.py --format open_clip`` writes what plain open_clip loads, with equal embeddings;
the same file starts a new run through ``pretrained:`` (fine-tuning or LiT)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
from pathlib import Path

import open_clip
import pytest
import torch

from mmssl.models.clip import CLIP

REPO = Path(__file__).resolve().parents[2]


def _export_tool():
    spec = importlib.util.spec_from_file_location("export_tool", REPO / "tools/export.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _trained_checkpoint(model: CLIP, path: Path) -> None:
    """A Lightning-style checkpoint of a model whose weights moved away from their init."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams)}, path)


def _inputs(model: CLIP) -> tuple[torch.Tensor, torch.Tensor]:
    images = torch.randn(3, 3, model.image_size, model.image_size, generator=torch.Generator().manual_seed(0))
    return images, model.tokenizer(["a small red circle", "a big blue square", "a green star"])


@pytest.mark.parametrize("loss", ["clip", "siglip"])
def test_exported_checkpoint_loads_in_plain_open_clip_with_equal_embeddings(tmp_path, tiny_clip_json, loss):
    model = CLIP(tiny_clip_json, loss=loss, flip={"mask_ratio": 0.5}).eval()
    _trained_checkpoint(model, tmp_path / "last.ckpt")
    output = tmp_path / "clip.pt"
    _export_tool().main(["--ckpt", str(tmp_path / "last.ckpt"), "--format", "open_clip", "--output", str(output)])

    # What a user does: register the JSON (built-in names need nothing), then load the file.
    open_clip.add_model_config(tiny_clip_json)
    name = Path(tiny_clip_json).stem
    extra = {"init_logit_bias": -10.0} if loss == "siglip" else {}  # a config without a bias
    theirs, _, preprocess = open_clip.create_model_and_transforms(name, pretrained=str(output), **extra)
    theirs.eval()
    images, tokens = _inputs(model)
    with torch.no_grad():
        torch.testing.assert_close(
            theirs.encode_image(images), model.encode_image(images, normalize=False), rtol=0, atol=1e-6
        )
        # mmssl's text tower stops at the longest caption (trim_text_padding): the same sums in
        # another blocking, so equal to float rounding rather than bit for bit.
        torch.testing.assert_close(
            theirs.encode_text(tokens), model.encode_text(tokens, normalize=False), rtol=0, atol=1e-5
        )
    assert theirs.logit_scale.item() == model.model.logit_scale.item()
    if loss == "siglip":
        assert theirs.logit_bias.item() == model.model.logit_bias.item()


def test_export_refuses_a_checkpoint_without_clip_weights(tmp_path):
    torch.save({"state_dict": {"encoder.weight": torch.zeros(1)}}, tmp_path / "mae.ckpt")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert _export_tool().main(["--ckpt", str(tmp_path / "mae.ckpt"), "--format", "open_clip",
                                    "--output", str(tmp_path / "x.pt")]) == 1
    assert err.getvalue().startswith("export: no 'model.logit_scale'") and "CLIP" in err.getvalue()


def test_pretrained_file_starts_a_lit_run_with_the_exported_image_tower(tmp_path, tiny_clip_json):
    source = CLIP(tiny_clip_json).eval()
    _trained_checkpoint(source, tmp_path / "last.ckpt")
    output = tmp_path / "clip.pt"
    _export_tool().main(["--ckpt", str(tmp_path / "last.ckpt"), "--format", "open_clip", "--output", str(output)])

    lit = CLIP(tiny_clip_json, pretrained=str(output), lock={"image": True}).eval()
    images, tokens = _inputs(source)
    with torch.no_grad():
        torch.testing.assert_close(lit.encode_image(images), source.encode_image(images))
        torch.testing.assert_close(lit.encode_text(tokens), source.encode_text(tokens))
    assert not any(p.requires_grad for p in lit.model.visual.parameters())


def test_siglit_from_a_clip_file_starts_at_the_siglip_bias(tmp_path, tiny_clip_json):
    source = CLIP(tiny_clip_json)  # softmax CLIP: its file has no logit_bias
    torch.save({"state_dict": source.state_dict()}, tmp_path / "last.ckpt")
    _export_tool().main(["--ckpt", str(tmp_path / "last.ckpt"), "--format", "open_clip",
                         "--output", str(tmp_path / "clip.pt")])
    siglit = CLIP(tiny_clip_json, loss="siglip", pretrained=str(tmp_path / "clip.pt"), lock={"image": True})
    assert siglit.model.logit_bias.item() == -10.0  # not open_clip's fill value 0
    assert siglit.model.logit_scale.item() == source.model.logit_scale.item()  # the file's
