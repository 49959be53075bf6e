"""The CLIP module: loss choice and init, FLIP masking and its FLOPs, towers, LiT, optimizer groups."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from mmssl.models.clip import CLIP
from mmssl.optim import param_groups
from mmssl.retrieval import retrieval_metrics

REPO = Path(__file__).resolve().parents[2]
TIMM_JSON = str(REPO / "configs/models/clip_micro_timm.json")
FLOPS_JSON = str(REPO / "configs/models/clip_tiny.json")  # 64 patches, 3 blocks: the patches dominate


def _images(model: CLIP, n: int = 2) -> torch.Tensor:
    return torch.randn(n, 3, model.image_size, model.image_size, generator=torch.Generator().manual_seed(0))


def _tokens_per_image(model: CLIP, blocks: torch.nn.Module) -> int:
    """Sequence length the first transformer block of the image tower sees."""
    seen: list[torch.Size] = []
    handle = blocks[0].register_forward_hook(lambda mod, inputs, out: seen.append(inputs[0].shape))
    model.encode_image(_images(model))
    handle.remove()
    return seen[0][1]  # both towers run batch-first: (B, L, D)


def test_loss_initialisation(tiny_clip_json):
    clip = CLIP(tiny_clip_json)
    assert clip.model.logit_scale.exp().item() == pytest.approx(1 / 0.07, rel=1e-5)
    assert clip.model.logit_bias is None
    siglip = CLIP(tiny_clip_json, loss="siglip")  # SigLIP sec. 3.2: t = 10, b = -10
    assert siglip.model.logit_scale.exp().item() == pytest.approx(10.0, rel=1e-5)
    assert siglip.model.logit_bias.item() == pytest.approx(-10.0)
    with pytest.raises(ValueError, match="model.loss"):
        CLIP(tiny_clip_json, loss="triplet")


def test_logit_scale_is_clamped_at_100_after_a_step(tiny_clip_json):
    model = CLIP(tiny_clip_json)
    with torch.no_grad():
        model.model.logit_scale.fill_(math.log(500.0))
    model.on_train_batch_end(None, None, 0)
    assert model.model.logit_scale.exp().item() == pytest.approx(100.0, rel=1e-5)


def test_flip_masks_half_the_patches_in_training_only(tiny_clip_json):
    model = CLIP(tiny_clip_json, flip={"mask_ratio": 0.5})  # 32 px / patch 8: 16 patches + cls
    blocks = model.model.visual.transformer.resblocks
    model.train()
    assert _tokens_per_image(model, blocks) == 1 + 8
    model.eval()  # evaluation and zero-shot see every patch, deterministically
    assert _tokens_per_image(model, blocks) == 1 + 16
    images = _images(model)
    torch.testing.assert_close(model.encode_image(images), model.encode_image(images))


def test_flip_halves_the_image_tower_flops(tiny_clip_json):
    def image_tower_flops(ratio: float) -> int:
        model = CLIP(FLOPS_JSON, flip={"mask_ratio": ratio}).train()
        # FlopCounterMode has no formula for the fused CPU attention kernels: count with math SDPA.
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            model.encode_image(_images(model))
        return counter.get_total_flops()

    full, masked = image_tower_flops(0.0), image_tower_flops(0.5)
    # 33 of 65 tokens per block; the patch embedding still runs on the whole image.
    assert 0.45 < masked / full < 0.6, (masked, full)


def test_timm_image_tower_from_json_with_flip_masking():
    model = CLIP(TIMM_JSON, flip={"mask_ratio": 0.5})  # timm "test_vit": random init, no download
    trunk = model.model.visual.trunk
    assert trunk.patch_drop is model.flip
    patches = (model.image_size // 16) ** 2
    model.train()
    assert _tokens_per_image(model, trunk.blocks) == 1 + patches // 2
    model.eval()
    assert _tokens_per_image(model, trunk.blocks) == 1 + patches
    out = model(_images(model), model.tokenizer(["a red circle", "a blue square"]))
    assert out["image_features"].shape == (2, model.embed_dim)


def test_every_parameter_gets_a_gradient(tiny_clip_json):
    for loss in ("clip", "siglip"):
        model = CLIP(tiny_clip_json, loss=loss, flip={"mask_ratio": 0.5})
        out = model(_images(model, 4), model.tokenizer(["a", "b", "c", "d"]))
        model.contrastive_loss(out).backward()
        missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
        assert not missing, f"{loss}: no gradient for {missing}"


def test_default_weight_decay_groups_follow_open_clip(tiny_clip_json):
    # open_clip_train/main.py: exclude = p.ndim < 2 or "bn"/"ln"/"bias"/"logit_scale" in n;
    # token and positional embeddings are 2-D, so they are decayed (as the CLIP paper does).
    model = CLIP(tiny_clip_json, loss="siglip")
    names = {id(p): n for n, p in model.named_parameters()}
    groups = param_groups(model, model.no_weight_decay, model._param_ndim, 0.2)
    decay, no_decay = (sorted(names[id(p)] for p in g["params"]) for g in groups)
    assert groups[1]["weight_decay"] == 0.0 and groups[0]["weight_decay"] == 0.2
    expected = sorted(
        n for n, p in model.named_parameters() if p.ndim < 2 or "ln" in n or "bias" in n or "logit_scale" in n
    )
    assert no_decay == expected
    for name in ("model.logit_scale", "model.logit_bias", "model.visual.class_embedding", "model.ln_final.weight"):
        assert name in no_decay
    for name in ("model.positional_embedding", "model.token_embedding.weight", "model.visual.positional_embedding",
                 "model.visual.conv1.weight", "model.text_projection"):
        assert name in decay


def test_lock_image_freezes_the_image_tower_only(tiny_clip_json):
    model = CLIP(tiny_clip_json, lock={"image": True})
    assert not any(p.requires_grad for p in model.model.visual.parameters())
    assert all(p.requires_grad for p in model.model.transformer.parameters())
    grouped = {id(p) for g in param_groups(model, model.no_weight_decay, model._param_ndim) for p in g["params"]}
    assert not grouped & {id(p) for p in model.model.visual.parameters()}


def test_retrieval_metrics_rank_the_matching_caption():
    features = torch.nn.functional.normalize(torch.randn(20, 8, generator=torch.Generator().manual_seed(0)), dim=-1)
    perfect = retrieval_metrics(features, features)
    assert all(v == 1.0 for v in perfect.values()) and len(perfect) == 6
    shifted = retrieval_metrics(features, features.roll(1, dims=0))
    assert shifted["i2t_R@1"] == 0.0 and shifted["t2i_R@1"] == 0.0


def test_bad_inputs_name_the_key(tiny_clip_json, tmp_path):
    with pytest.raises(FileNotFoundError, match="model.pretrained"):
        CLIP(tiny_clip_json, pretrained=str(tmp_path / "missing.pt"))
    with pytest.raises(ValueError, match="model.flip.mask_ratio"):
        CLIP(tiny_clip_json, flip={"mask_ratio": 1.0})


def test_trimmed_text_padding_gives_open_clips_embeddings_and_gradients(tiny_clip_json):
    torch.manual_seed(0)
    model = CLIP(tiny_clip_json)
    assert model.trim_text_padding  # causal text tower with argmax pooling: on by default
    tokens = model.tokenizer(["a photo of a bag", "a longer caption about an ankle boot at night"])
    longest = int((tokens != 0).sum(dim=1).max())
    assert longest < tokens.shape[1]
    seen = []
    handle = model.model.transformer.resblocks[0].register_forward_hook(lambda m, i, o: seen.append(i[0].shape[1]))
    mine = model.encode_text(tokens)
    handle.remove()
    assert seen == [longest]  # the text tower ran only up to the longest caption
    reference = model.model.encode_text(tokens, normalize=True)  # open_clip, full context
    torch.testing.assert_close(mine, reference, atol=1e-6, rtol=1e-5)
    # Gradients too: a training step is the same step.
    images = _images(model)
    grads = []
    for trim in (True, False):
        model.zero_grad()
        model.trim_text_padding = trim
        model.contrastive_loss(model(images, tokens)).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-4, msg=name)


def test_trimming_is_refused_where_padding_changes_the_output(tmp_path):
    config = {
        "embed_dim": 16,
        "vision_cfg": {"image_size": 16, "layers": 1, "width": 16, "head_width": 8, "patch_size": 8},
        "text_cfg": {"context_length": 8, "vocab_size": 49408, "width": 16, "heads": 2, "layers": 1,
                     "no_causal_mask": True, "pool_type": "last"},
    }
    path = tmp_path / "clip_bidirectional_text.json"
    path.write_text(json.dumps(config))
    assert not CLIP(str(path)).trim_text_padding  # auto: off for a bidirectional tower
    with pytest.raises(ValueError, match="model.trim_text_padding"):
        CLIP(str(path), trim_text_padding=True)


def test_hugging_face_tokenizer_is_read_locally_never_downloaded(tmp_path):
    from mmssl.models.clip import build_tokenizer, resolve_model_name

    name = resolve_model_name(str(Path(__file__).resolve().parents[2] / "configs/models/siglip_vit_b16.json"))
    with pytest.raises(FileNotFoundError, match="huggingface-cli download timm/ViT-B-16-SigLIP"):
        build_tokenizer(name)  # no folder given: a clear error, not a download
    with pytest.raises(FileNotFoundError, match="model.tokenizer"):
        build_tokenizer(name, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="built-in BPE"):
        build_tokenizer("ViT-B-32", str(tmp_path))
