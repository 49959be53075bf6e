"""``tools/export.py --format hf`` on the SigLIP recipe's tower shape writes a transformers
``SiglipModel`` folder: equal embeddings and logits, the tokenizer's ids, and the zero-shot pipeline.

The towers are ``ViT-B-16-SigLIP``'s (configs/models/siglip_vit_b16.json) made tiny: a timm ViT
without a class token, MAP-pooled, registered here because open_clip builds timm towers by name;
a bidirectional text tower pooled at the last token with a biased projection; a Hugging Face
tokenizer in a local folder (as the recipe's SentencePiece one), or open_clip's BPE."""

from __future__ import annotations

import json

import pytest
import torch
from timm.models import register_model
from timm.models.vision_transformer import _create_vision_transformer

from mmssl.export import EXPORT_FILE_NAMES
from mmssl.models.clip import CLIP
from tests.export.test_export_formats import _export, _export_refused, _perturbed

transformers = pytest.importorskip("transformers")

ATOL = 1e-5  # fp32; measured differences are ~1e-7
CAPTIONS = ["a red circle", "a blue square", "a green star"]
WORDS = ["a", "red", "blue", "green", "circle", "square", "star", "this", "is", "photo", "of"]


@register_model
def mmssl_test_siglip_tiny(pretrained: bool = False, **kwargs):
    """vit_base_patch16_siglip_224's shape (no class token, MAP pool) at 32 px, width 32, 2 blocks."""
    args = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, class_token=False, global_pool="map")
    return _create_vision_transformer("mmssl_test_siglip_tiny", pretrained=False, **dict(args, **kwargs))


def _hf_tokenizer(folder) -> int:
    """A word-level fast tokenizer saved as a transformers folder; ends each text with </s>."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {w: i for i, w in enumerate(["<pad>", "</s>", "<unk>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(str(folder))
    return len(vocab)


def _config(tokenizer: str, vocab_size: int, context: int, **vision) -> dict:
    text = {"context_length": context, "vocab_size": vocab_size, "width": 32, "heads": 2, "layers": 2,
            "no_causal_mask": True, "proj_bias": True, "pool_type": "last", "norm_kwargs": {"eps": 1e-6}}
    if tokenizer == "hf":
        text.update(hf_tokenizer_name="local/tiny", tokenizer_kwargs={"clean": "canonicalize"})
    return {"embed_dim": 32, "init_logit_bias": -10, "custom_text": True, "text_cfg": text,
            "vision_cfg": {"image_size": 32, "timm_model_name": "mmssl_test_siglip_tiny",
                           "timm_model_pretrained": False, "timm_pool": "map", "timm_proj": "none", **vision}}


def _checkpoint(folder, tokenizer: str, context: int = 16, **vision):
    """A trained-looking SigLIP checkpoint (a name without "siglip": open_clip would pick T5's BPE)."""
    vocab, tok_dir = 49408, None
    if tokenizer == "hf":
        tok_dir = folder / "tokenizer"
        vocab = _hf_tokenizer(tok_dir)
    path = folder / "tiny_sig.json"
    path.write_text(json.dumps(_config(tokenizer, vocab, context, **vision)))
    model = _perturbed(CLIP(str(path), loss="siglip", tokenizer=None if tok_dir is None else str(tok_dir)))
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams)}, folder / "last.ckpt")
    return model, folder / "last.ckpt"


# The recipe's shape (an HF tokenizer, 16 tokens as in the paper) and open_clip's released one
# (64 tokens, the length transformers' zero-shot pipeline pads SigLIP prompts to), here with BPE.
@pytest.fixture(scope="module", params=[("hf", 16), ("bpe", 64)], ids=["hf_tokenizer-16", "bpe-64"])
def siglip_export(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"siglip_{request.param[0]}")
    model, ckpt = _checkpoint(folder, *request.param)
    _export("--ckpt", str(ckpt), "--format", "hf", "--output", str(folder / "hf"))
    return model, folder / "hf"


def test_siglip_model_loads_with_no_missing_keys_and_equal_outputs(siglip_export):
    model, folder = siglip_export
    assert {p.name for p in folder.iterdir()} <= EXPORT_FILE_NAMES  # what --overwrite may replace
    hf, info = transformers.SiglipModel.from_pretrained(str(folder), output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    processor = transformers.AutoProcessor.from_pretrained(str(folder))
    assert type(processor).__name__ == "SiglipProcessor"
    assert type(processor.image_processor).__name__.startswith("SiglipImageProcessor")
    images = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    tokens = model.tokenizer(CAPTIONS)
    batch = processor.tokenizer(CAPTIONS, padding="max_length", max_length=tokens.shape[1], return_tensors="pt")
    assert batch["input_ids"].tolist() == tokens.tolist()  # the same ids, padding included
    assert "attention_mask" not in batch  # the tower attends to its padding, as in training
    with torch.no_grad():
        image, text = model.encode_image(images, normalize=False), model.encode_text(tokens, normalize=False)
        logits = model.model.logit_scale.exp() * model.encode_image(images) @ model.encode_text(tokens).T
        logits = logits + model.model.logit_bias
        hf_image = hf.get_image_features(pixel_values=images).pooler_output
        hf_text = hf.get_text_features(input_ids=tokens).pooler_output
        out = hf(input_ids=tokens, pixel_values=images)
    torch.testing.assert_close(hf_image, image, rtol=0, atol=ATOL)
    torch.testing.assert_close(hf_text, text, rtol=0, atol=ATOL)
    torch.testing.assert_close(out.logits_per_image, logits, rtol=0, atol=ATOL)
    assert list(processor.image_processor.image_mean) == pytest.approx(model.image_mean)
    assert processor.image_processor.size["height"] == model.image_size == hf.config.vision_config.image_size


def test_zero_shot_pipeline_scores_are_the_models_sigmoids(siglip_export):
    from PIL import Image

    model, folder = siglip_export
    classifier = transformers.pipeline("zero-shot-image-classification", model=str(folder))
    pixels = torch.randint(0, 256, (32, 32, 3), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    image = Image.fromarray(pixels.numpy())  # at the model's size: the processor's resize changes nothing
    labels = ["red circle", "blue square"]
    if model.model.context_length != 64:
        # transformers 5.24 pads SigLIP prompts to 64 tokens and drops the call's tokenizer_kwargs
        # (ZeroShotImageClassificationPipeline._sanitize_parameters): a 16-token model loads in the
        # pipeline but runs only through the processor and model (docs/export.md). This fails
        # when transformers honours max_length, the moment to update the docs.
        with pytest.raises(ValueError, match="max_position_embeddings"):
            classifier(image, candidate_labels=labels, tokenizer_kwargs={"max_length": 16})
        return
    scores = {r["label"]: r["score"] for r in classifier(image, candidate_labels=labels, hypothesis_template="a {}")}
    mean, std = torch.tensor(model.image_mean).view(3, 1, 1), torch.tensor(model.image_std).view(3, 1, 1)
    x = ((pixels.permute(2, 0, 1).float() / 255 - mean) / std)[None]
    with torch.no_grad():
        logits = model.model.logit_scale.exp() * model.encode_image(x) @ model.encode_text(
            model.tokenizer([f"a {c}" for c in labels])).T + model.model.logit_bias
    assert [scores[c] for c in labels] == pytest.approx(torch.sigmoid(logits[0]).tolist(), abs=1e-5)


def test_siglip_export_refuses_parts_siglip_model_cannot_hold(tmp_path):
    _, ckpt = _checkpoint(tmp_path, "bpe", timm_proj="linear")
    refused = _export_refused("--ckpt", str(ckpt), "--format", "hf", "--output", str(tmp_path / "hf"))
    assert "image projection" in refused and "timm_proj" in refused
    assert not (tmp_path / "hf").exists()  # a refused export writes nothing
