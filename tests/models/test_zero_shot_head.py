"""WiSE-FT's zero-shot head: an ImageClassifier started from a CLIP (timm tower) with its head made
from the class prompts predicts, at step 0, exactly what the CLIP's zero-shot classifier predicts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mmssl.checkpoints.load import load_lightning
from mmssl.evaluation.zero_shot import build_zero_shot_classifier
from mmssl.models.classifier import ImageClassifier
from mmssl.models.clip import CLIP

REPO = Path(__file__).resolve().parents[2]
NAMES = ["red circle", "blue square", "green star", "gray cross", "black diamond"]
TEMPLATES = ["a drawing of a {c}.", "a {c} on a background."]


@pytest.fixture(scope="module")
def clip_file(tmp_path_factory) -> tuple[Path, CLIP, Path]:
    """A CLIP with a timm tower (test_vit, token pool, linear projection with a bias) saved as a
    checkpoint, and a class-names file with its templates beside it."""
    folder = tmp_path_factory.mktemp("zs_head")
    config = json.loads((REPO / "configs/models/clip_micro_timm.json").read_text())
    config["vision_cfg"]["timm_proj_bias"] = True
    (folder / "clip_timm_bias.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    clip = CLIP(str(folder / "clip_timm_bias.json"), init_logit_scale=2.0).eval()
    with torch.no_grad():
        clip.model.visual.head.proj.bias.normal_()  # a bias that matters
    torch.save({"state_dict": clip.state_dict(), "hyper_parameters": dict(clip.hparams)}, folder / "clip.ckpt")
    (folder / "classnames.txt").write_text("\n".join(NAMES) + "\n")
    (folder / "zeroshot_classification_templates.txt").write_text("\n".join(TEMPLATES) + "\n")
    return folder / "clip.ckpt", clip, folder / "classnames.txt"


def _classifier(ckpt: Path, names: Path, **kwargs) -> ImageClassifier:
    args = dict(num_classes=len(NAMES), model_name="test_vit", image_size=160, global_pool="token",
                drop_path_rate=0.0, mixup=0.0, cutmix=0.0, init_encoder=str(ckpt), zero_shot_head=str(ckpt),
                head_classnames=str(names))
    return ImageClassifier(**{**args, **kwargs}).eval()


@torch.no_grad()
def test_the_classifier_starts_with_the_clips_zero_shot_predictions(clip_file):
    ckpt, clip, names = clip_file
    classifier = _classifier(ckpt, names)
    images = torch.randn(16, 3, 160, 160)
    text = build_zero_shot_classifier(clip.encode_text, clip.tokenizer, NAMES, TEMPLATES, torch.device("cpu"))  # (D, C)
    embedding = clip.encode_image(images, normalize=False)  # (B, D)
    zero_shot = F.normalize(embedding, dim=-1) @ text  # what mmssl.evaluation.zero_shot scores
    logits = classifier(images)  # (B, C)
    assert torch.equal(logits.argmax(dim=1), zero_shot.argmax(dim=1))
    # Exactly the CLIP's logits, each image's scaled by the norm of its embedding (no normalisation in a timm head).
    expected = clip.model.logit_scale.exp() * embedding.norm(dim=-1, keepdim=True) * zero_shot
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    assert len(set(zero_shot.argmax(dim=1).tolist())) > 1  # not one class for every image


def test_a_saved_classifier_loads_without_the_clip_file(clip_file, tmp_path):
    ckpt, _, names = clip_file
    classifier = _classifier(ckpt, names)
    saved = tmp_path / "ft.ckpt"
    hparams = {**dict(classifier.hparams), "zero_shot_head": str(tmp_path / "gone.ckpt"),
               "init_encoder": str(tmp_path / "gone.ckpt"), "_class_path": "mmssl.models.classifier.ImageClassifier"}
    torch.save({"state_dict": classifier.state_dict(), "hyper_parameters": hparams}, saved)
    loaded = load_lightning(str(saved))
    assert torch.equal(loaded.model.head.weight, classifier.model.head.weight)


def test_what_cannot_make_a_zero_shot_head_is_refused(clip_file, tiny_clip_json, tmp_path):
    ckpt, _, names = clip_file
    with pytest.raises(ValueError, match="needs model.head_classnames"):
        _classifier(ckpt, names, head_classnames=None)
    with pytest.raises(ValueError, match="global_pool='avg' but the CLIP tower .* timm_pool='token'"):
        _classifier(ckpt, names, global_pool="avg", init_encoder=None)
    with pytest.raises(ValueError, match=r"head of shape \(5, 64\).*classifier's is \(3, 64\)"):
        _classifier(ckpt, names, num_classes=3)
    vit_clip = CLIP(tiny_clip_json)
    torch.save({"state_dict": vit_clip.state_dict(), "hyper_parameters": dict(vit_clip.hparams)}, tmp_path / "vit.ckpt")
    with pytest.raises(ValueError, match="open_clip's own ViT, not a timm model"):
        _classifier(tmp_path / "vit.ckpt", names, init_encoder=None)
