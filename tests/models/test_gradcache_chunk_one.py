"""GradCache's smallest chunk: one sample at a time gives the features and gradients of the
whole batch (the most memory it can save); zero is refused naming the option."""

from __future__ import annotations

import pytest
import torch

from mmssl.models.gradcache import cached_features


def test_chunks_of_one_sample_give_the_whole_batch_features_and_gradients():
    g = torch.Generator().manual_seed(0)
    image_tower, text_tower = torch.nn.Linear(12, 4), torch.nn.Embedding(10, 4)
    images, tokens = torch.randn(3, 3, 2, 2, generator=g), torch.randint(0, 10, (3, 5), generator=g)

    def encode(i, t):
        return image_tower(i.flatten(1)), text_tower(t).mean(dim=1)

    grads = []
    for chunk in (1, 3):
        image_tower.zero_grad(), text_tower.zero_grad()
        image, text = cached_features(encode, images, tokens, chunk)
        (image @ text.T).logsumexp(dim=1).sum().backward()  # features of different samples meet
        grads.append([p.grad.clone() for p in (*image_tower.parameters(), *text_tower.parameters())])
        if chunk == 1:
            first = (image.detach(), text.detach())
    whole = encode(images, tokens)
    torch.testing.assert_close(first[0], whole[0].detach())
    torch.testing.assert_close(first[1], whole[1].detach())
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="model.contrastive_chunk_size must be >= 1, got 0"):
        cached_features(encode, images, tokens, 0)


def test_a_batch_with_more_images_than_captions_is_refused_with_both_counts():
    from mmssl.models.gradcache import cached_features

    with pytest.raises(ValueError, match=r"^cached_features: 4 images but 3 captions$"):
        cached_features(lambda i, t: (i, t), torch.zeros(4, 3, 2, 2), torch.zeros(3, 5, dtype=torch.long), 2)
