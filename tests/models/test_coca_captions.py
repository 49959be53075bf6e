"""CoCa captioning end to end: the decoder's generation path is the teacher-forced one, and a
CoCa overfitted on a few captions gives them back exactly, greedy and by beam search (a wrong
start/end id, label shift, image-to-beam pairing or decode would change a caption)."""

from __future__ import annotations

import pytest
import torch

from mmssl.evaluation.captions import generate_captions
from mmssl.models.coca import CoCa

CAPTIONS = ["a small red circle in the top left", "a large blue square on black", "a drawing of a green star"]


@pytest.fixture(scope="module")
def overfitted(tiny_coca_json) -> tuple[CoCa, torch.Tensor]:
    """A tiny CoCa trained (contrastive + caption loss, as ``mmssl fit``) on 3 images and captions
    until its teacher-forced caption loss is near zero, and the 3 images."""
    torch.manual_seed(0)
    model = CoCa(tiny_coca_json, warmup_steps=0).train()
    images = torch.randn(len(CAPTIONS), 3, 32, 32, generator=torch.Generator().manual_seed(1))
    tokens = model.tokenizer(CAPTIONS)  # (3, 16): SOT, caption, EOT, pad
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.0)
    for _ in range(150):
        contrastive, caption = model.losses(images, tokens)
        optimizer.zero_grad()
        (contrastive + caption).backward()
        optimizer.step()
        if caption.item() < 0.1:  # caption_loss_weight 2 x the token mean: 0.05 nats a token
            break
    return model.eval(), images


def test_generation_sees_the_logits_of_teacher_forcing(overfitted):
    model, images = overfitted
    tokens = model.tokenizer(CAPTIONS)
    with torch.no_grad():
        forced = model(images, tokens)["logits"]  # (3, 15, V): position t predicts tokens[:, t + 1]
        encoded = model.model(images)  # what generation encodes once per image
        prefix = model.model(None, tokens[:, :-1], image_latent=encoded["image_features"],
                             image_embs=encoded["image_embs"], output_labels=False)["logits"]
    torch.testing.assert_close(prefix, forced, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("generation_type, params", [("top_k", {"top_k": 1}), ("beam_search", {"num_beams": 3})])
def test_an_overfitted_coca_captions_its_training_images_exactly(overfitted, generation_type, params):
    model, images = overfitted
    assert generate_captions(model, images, generation_type, seq_len=16, min_seq_len=2, **params) == CAPTIONS
