"""CoCa's validation figures (mmssl.models.clip.CLIP.validation_step with its objectives) against a hand computation:
``val/loss`` (what ModelCheckpoint monitors) is ``clip_loss_weight`` x InfoNCE + ``caption_loss_weight``
x the caption token mean, per batch, averaged over batches by their samples; ``val/caption_loss``
is the unweighted token mean over all batches; ``val/caption_token_top1`` the next-token accuracy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mmssl.models.coca import CoCa

CAPTIONS = ["red", "a large blue square on black", "a star", "a drawing of a green cross in the middle", "two dots"]


def test_validation_loss_is_the_weighted_sum_the_training_loss_is(tiny_coca_json):
    torch.manual_seed(0)
    model = CoCa(tiny_coca_json, caption_loss_weight=3.0, clip_loss_weight=0.5, warmup_steps=0).eval()
    # A decoder that always predicts end-of-text: one right token per caption, so the token accuracy's
    # weighting over batches of different token counts is seen.
    decoder, eot = model.model.text_decoder, model.generation_ids()["eos_token_id"]
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        decoder.ln_final.bias.copy_(torch.randn(decoder.ln_final.bias.shape, generator=g))
        decoder.text_projection[:, eot] = 20 * decoder.ln_final.bias
    batches = [(torch.randn(3, 3, 32, 32, generator=g), model.tokenizer(CAPTIONS[:3])),
               (torch.randn(2, 3, 32, 32, generator=g), model.tokenizer(CAPTIONS[3:]))]
    losses, contrastives, weights, ce_sum, right, tokens = [], [], [], 0.0, 0.0, 0
    with torch.no_grad():
        for i, (images, text) in enumerate(batches):
            model.validation_step({"image": images, "text": text}, i)
            out = model(images, text)
            logits = out["logit_scale"] * out["image_features"] @ out["text_features"].T  # (B, B)
            target = torch.arange(len(images))
            contrastive = (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2
            labels, mask = out["labels"], out["labels"] != model.pad_id  # (B, L-1)
            ce = F.cross_entropy(out["logits"][mask], labels[mask], reduction="sum")
            losses.append(0.5 * contrastive + 3.0 * ce / mask.sum())
            weights.append(len(images))
            contrastives.append(float(contrastive))
            ce_sum, tokens = ce_sum + float(ce), tokens + int(mask.sum())
            right += float((out["logits"].argmax(dim=-1)[mask] == labels[mask]).sum())
    assert right == len(CAPTIONS)
    assert tokens > 3 * 5  # padded captions of different lengths: token means differ from sample means
    want = sum(w * float(v) for w, v in zip(weights, losses)) / sum(weights)
    assert model.validation.loss.compute().item() == pytest.approx(want, rel=1e-5)
    want = sum(w * c for w, c in zip(weights, contrastives)) / sum(weights)
    assert model.objectives["contrastive"].val_loss.compute().item() == pytest.approx(want, rel=1e-5)
    assert model.objectives["caption"].val_loss.compute().item() == pytest.approx(ce_sum / tokens, rel=1e-5)
    assert model.objectives["caption"].val_token_top1.compute().item() == pytest.approx(right / tokens, rel=1e-5)
