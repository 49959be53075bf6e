"""M3AE's decoder leaves the caption padding (what follows the EOT) out of attention: a caption
decodes alike in a short context and in a longer one that only adds padding."""

from __future__ import annotations

import torch

from mmssl.models.m3ae import M3AE

TINY = dict(image_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, decoder_embed_dim=32,
            decoder_depth=1, decoder_num_heads=2, text_length=16)


def test_padding_after_the_eot_changes_no_decoder_output():
    """The decoder's padding slots hold the mask token at their positions; were they attended, the
    image predictions and the caption's token states would change with the context's length."""
    torch.manual_seed(0)
    model = M3AE(**TINY).eval()
    captions = ["a dog on the grass", "two red cars in a street"]
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    tokens = model.tokenizer(captions)  # (2, 16): SOT, the words, EOT, then padding
    image_noise, text_noise = torch.rand(2, 2, 16, generator=torch.Generator().manual_seed(2))
    outputs = []
    for length in (10, 16):  # both captions end (EOT) before position 10
        ids = tokens[:, :length]
        x, image_masking, text_masking, padding = model.forward_encoder(images, ids, None, image_noise,
                                                                        text_noise[:, :length])
        assert padding[:, 9].all()
        outputs.append(model.forward_decoder(x, image_masking, text_masking, padding))
    (pred, states), (pred_long, states_long) = outputs
    torch.testing.assert_close(pred_long, pred)
    torch.testing.assert_close(states_long[:, :10], states)
