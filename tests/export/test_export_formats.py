"""Round trips mmssl checkpoint -> folder format -> the target library's own loader -> equal outputs:
transformers ``CLIPModel`` (``--format hf``), open_clip ``local-dir:`` (``open_clip_hf``) and timm
(``--format timm`` into a folder)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
from pathlib import Path

import open_clip
import pytest
import timm
import torch

from mmssl.export import EXPORT_FILE_NAMES
from mmssl.models.clip import CLIP
from mmssl.models.mae import MAE

REPO = Path(__file__).resolve().parents[2]
# Two blocks per tower (the per-block renaming is exercised), small widths; the token table is
# fixed at open_clip's 49408 BPE tokens.
TINY = {"embed_dim": 24,
        "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "head_width": 16, "patch_size": 8},
        "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2}}
CAPTIONS = ["a small red circle", "A big, blue square!", "green star in the top-left (large)"]
ATOL = 1e-4  # the parity bound; measured differences are ~1e-6


def _main(argv) -> int:
    spec = importlib.util.spec_from_file_location("export_tool", REPO / "tools/export.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(list(argv))


def _export(*argv: str) -> None:
    assert _main(argv) == 0


def _export_refused(*argv: str) -> str:
    """``tools/export.py ARGV`` that must fail: exit 1 and the one stderr line naming what is wrong."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert _main(argv) == 1
    assert err.getvalue().startswith("export: ") and err.getvalue().count("\n") == 1, err.getvalue()
    return err.getvalue()


def _perturbed(module: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Move every weight off its init, so a round trip cannot pass on shared initialisation."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return module.eval()


CLIP_KINDS = ["clip", "siglip", "quick_gelu"]


@pytest.fixture(scope="module", params=CLIP_KINDS)
def clip_ckpt(request, tmp_path_factory):
    """A trained-looking mmssl CLIP checkpoint (softmax, SigLIP with bias, or QuickGELU towers)."""
    folder = tmp_path_factory.mktemp(f"clip_{request.param}")
    config = dict(TINY, quick_gelu=True) if request.param == "quick_gelu" else TINY
    # Named tiny_0..2: open_clip picks a SigLIP (T5) tokenizer for any name containing "siglip".
    path = folder / f"tiny_{CLIP_KINDS.index(request.param)}.json"
    path.write_text(json.dumps(config))
    model = _perturbed(CLIP(str(path), loss="siglip" if request.param == "siglip" else "clip"))
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams)}, folder / "last.ckpt")
    return model, folder / "last.ckpt"


def _ours(model: CLIP):
    images = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    tokens = model.tokenizer(CAPTIONS)
    with torch.no_grad():
        image, text = model.encode_image(images, normalize=False), model.encode_text(tokens, normalize=False)
        n_image, n_text = model.encode_image(images), model.encode_text(tokens)
        logits = model.model.logit_scale.exp() * n_image @ n_text.T
    return images, tokens, image, text, logits


def test_hf_clip_model_loads_with_no_missing_keys_and_equal_outputs(clip_ckpt, tmp_path):
    transformers = pytest.importorskip("transformers")
    model, ckpt = clip_ckpt
    _export("--ckpt", str(ckpt), "--format", "hf", "--output", str(tmp_path / "hf"))
    written = {p.name for p in (tmp_path / "hf").iterdir()}
    assert {"config.json", "model.safetensors", "preprocessor_config.json", "vocab.json", "merges.txt"} <= written
    assert written <= EXPORT_FILE_NAMES  # what --overwrite may replace
    hf, info = transformers.CLIPModel.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    processor = transformers.CLIPProcessor.from_pretrained(str(tmp_path / "hf"))
    images, tokens, image, text, logits = _ours(model)

    # The tokenizer rebuilt from open_clip's BPE vocabulary gives open_clip's ids (open_clip pads
    # with 0, transformers with <|endoftext|>: equal up to the first end-of-text token).
    batch = processor.tokenizer(CAPTIONS, padding="max_length", return_tensors="pt")
    assert batch["input_ids"].shape == tokens.shape
    for ids, ref in zip(batch["input_ids"], tokens):
        end = int((ref == 49407).nonzero()[0]) + 1
        assert ids[:end].tolist() == ref[:end].tolist()
    with torch.no_grad():
        hf_image = hf.get_image_features(pixel_values=images)
        hf_text = hf.get_text_features(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        # transformers 5 returns an output object (pooler_output), 4.x the tensor
        hf_image, hf_text = (getattr(x, "pooler_output", x) for x in (hf_image, hf_text))
        out = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], pixel_values=images)
    torch.testing.assert_close(hf_image, image, rtol=0, atol=ATOL)
    torch.testing.assert_close(hf_text, text, rtol=0, atol=ATOL)
    torch.testing.assert_close(out.logits_per_image, logits, rtol=0, atol=ATOL)

    # The image processor carries the model's size and normalisation.
    processed = processor.image_processor
    assert list(processed.image_mean) == pytest.approx(model.image_mean)
    assert list(processed.image_std) == pytest.approx(model.image_std)
    assert processed.crop_size["height"] == model.image_size == hf.config.vision_config.image_size
    if model.model.logit_bias is not None:  # SigLIP: the bias rides in the config
        assert hf.config.logit_bias == pytest.approx(model.model.logit_bias.item())


def test_hf_export_refuses_towers_transformers_cannot_hold(tmp_path):
    timm_tower = _perturbed(CLIP(str(REPO / "configs/models/clip_micro_timm.json")))
    torch.save(
        {"state_dict": timm_tower.state_dict(), "hyper_parameters": dict(timm_tower.hparams)}, tmp_path / "t.ckpt"
    )
    refused = _export_refused(  # NotRepresentable
        "--ckpt", str(tmp_path / "t.ckpt"), "--format", "hf", "--output", str(tmp_path / "hf")
    )
    assert re.search("TimmModel.*--format open_clip_hf", refused)
    attn_pool = dict(TINY, vision_cfg=dict(TINY["vision_cfg"], pool_type="avg"))
    (tmp_path / "avg.json").write_text(json.dumps(attn_pool))
    avg = CLIP(str(tmp_path / "avg.json"))
    torch.save({"state_dict": avg.state_dict(), "hyper_parameters": dict(avg.hparams)}, tmp_path / "a.ckpt")
    refused = _export_refused(  # NotRepresentable
        "--ckpt", str(tmp_path / "a.ckpt"), "--format", "hf", "--output", str(tmp_path / "hf2")
    )
    assert re.search("pooling 'avg'", refused)


def test_open_clip_hub_folder_loads_through_local_dir_with_equal_outputs(clip_ckpt, tmp_path):
    model, ckpt = clip_ckpt
    folder = tmp_path / "oc"
    _export("--ckpt", str(ckpt), "--format", "open_clip_hf", "--output", str(folder))
    assert {p.name for p in folder.iterdir()} == {"open_clip_config.json", "open_clip_model.safetensors"}
    assert {p.name for p in folder.iterdir()} <= EXPORT_FILE_NAMES
    theirs, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{folder}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{folder}")
    theirs.eval()
    images, tokens, image, text, logits = _ours(model)
    assert torch.equal(tokenizer(CAPTIONS), tokens)
    with torch.no_grad():
        torch.testing.assert_close(theirs.encode_image(images), image, rtol=0, atol=ATOL)
        torch.testing.assert_close(theirs.encode_text(tokens), text, rtol=0, atol=ATOL)
        n_image, n_text = theirs.encode_image(images, normalize=True), theirs.encode_text(tokens, normalize=True)
        torch.testing.assert_close(theirs.logit_scale.exp() * n_image @ n_text.T, logits, rtol=0, atol=ATOL)
    if model.model.logit_bias is not None:
        assert theirs.logit_bias.item() == model.model.logit_bias.item()
    normalize = preprocess.transforms[-1]
    assert tuple(normalize.mean) == pytest.approx(model.image_mean) and tuple(normalize.std) == pytest.approx(
        model.image_std
    )


def test_mae_encoder_timm_folder_loads_by_local_dir_and_by_file_overlay(tmp_path):
    mae = _perturbed(MAE(image_size=32, patch_size=4, embed_dim=64, depth=2, num_heads=4, decoder_embed_dim=32,
                         decoder_depth=1, decoder_num_heads=4, image_mean=(0.5, 0.4, 0.3), image_std=(0.2, 0.25, 0.3)))
    torch.save({"state_dict": mae.state_dict(), "hyper_parameters": dict(mae.hparams)}, tmp_path / "mae.ckpt")
    folder = tmp_path / "vit"
    _export("--ckpt", str(tmp_path / "mae.ckpt"), "--format", "timm", "--output", str(folder))
    assert {"config.json", "model.safetensors"} <= {p.name for p in folder.iterdir()} <= EXPORT_FILE_NAMES
    config = json.loads((folder / "config.json").read_text())
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, ours_tokens = mae.encode_image(images), mae.forward_features(images)
    by_dir = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    by_file = timm.create_model(config["architecture"], pretrained=True, **config["model_args"],
                                pretrained_cfg_overlay=dict(file=str(folder / "model.safetensors"))).eval()
    for vit in (by_dir, by_file):
        with torch.no_grad():
            torch.testing.assert_close(vit(images), ours, rtol=0, atol=ATOL)
            torch.testing.assert_close(vit.forward_features(images), ours_tokens, rtol=0, atol=ATOL)
    data = timm.data.resolve_data_config(model=by_dir)
    assert data["mean"] == pytest.approx((0.5, 0.4, 0.3)) and data["std"] == pytest.approx((0.2, 0.25, 0.3))
    assert data["input_size"] == (3, 32, 32)


def test_folder_formats_refuse_what_they_cannot_write(tmp_path):
    mae = MAE(image_size=32, patch_size=4, embed_dim=64, depth=1, num_heads=4, decoder_embed_dim=32,
              decoder_depth=1, decoder_num_heads=4)
    torch.save({"state_dict": mae.state_dict(), "hyper_parameters": dict(mae.hparams)}, tmp_path / "mae.ckpt")
    refused = _export_refused(  # ValueError
        "--ckpt", str(tmp_path / "mae.ckpt"), "--format", "open_clip_hf", "--output", str(tmp_path / "x")
    )
    assert re.search("needs an mmssl CLIP or CLIPMLM checkpoint, not a MAE", refused)
    refused = _export_refused(  # ValueError
        "--ckpt", str(tmp_path / "mae.ckpt"), "--format", "hf", "--output", str(tmp_path / "x.safetensors")
    )
    assert re.search("writes a folder", refused)
