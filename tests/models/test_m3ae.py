"""M3AE (mmssl.models.m3ae): gradients everywhere, removed tokens unseen, captions without a target,
refused settings, sample-determined validation masks. The CLI runs: test_m3ae_cli.py."""

from __future__ import annotations

import pytest
import torch

from mmssl.models.m3ae import M3AE

TINY = dict(image_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, decoder_embed_dim=32,
            decoder_depth=1, decoder_num_heads=2, text_length=16)


def _batch(model: M3AE, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(len(captions), 3, 32, 32, generator=torch.Generator().manual_seed(0)), model.tokenizer(captions)


def test_every_parameter_gets_a_gradient_and_the_loss_is_image_plus_weighted_text():
    torch.manual_seed(0)
    model = M3AE(**TINY, text_loss_weight=0.3)
    images, tokens = _batch(model, ["a dog on the grass", "two red cars in a street", "x"])
    out = model(images, tokens, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(out.loss, out.image_loss + 0.3 * out.text_loss)
    torch.testing.assert_close(out.text_loss, out.text_ce_sum / out.text_count)
    # 5, 6 and 1 maskable words: int(n * 0.25) = 1, 1, 0 kept, so 4 + 5 + 1 targets.
    assert out.text_count == 10 and out.captions_without_target == 0
    out.loss.backward()
    assert [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None] == []
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_a_removed_token_in_a_filler_slot_reaches_neither_encoder_nor_decoder():
    """The short caption keeps 3 tokens, the long one 4: the short row's 4th kept slot is filler
    holding a removed token. Changing that token's id changes no real encoder output (attention
    keys are masked) and no decoder output (the slot is replaced by the mask token)."""
    torch.manual_seed(0)
    model = M3AE(**TINY).eval()
    images, tokens = _batch(model, ["a dog on the grass", "two red cars parked in a long city street"])
    image_noise, text_noise = torch.rand(2, 2, 16, generator=torch.Generator().manual_seed(2))
    outputs = []
    for ids in (tokens, tokens.clone()):
        if outputs:
            filler = outputs[0][1].ids_keep[0, 3]
            ids[0, filler] = 1000
        x, image_masking, text_masking, padding = model.forward_encoder(images, ids, None, image_noise, text_noise)
        outputs.append((x, text_masking, model.forward_decoder(x, image_masking, text_masking, padding)))
    (x, text_masking, (pred, states)), (y, _, (pred2, states2)) = outputs
    assert text_masking.keep_valid.tolist() == [[True] * 3 + [False], [True] * 4]
    assert text_masking.mask[0, text_masking.ids_keep[0, 3]] == 1  # the filler is a target
    real = torch.cat([torch.ones(2, x.shape[1] - 4, dtype=torch.bool), text_masking.keep_valid], dim=1)
    torch.testing.assert_close(x[real], y[real])
    torch.testing.assert_close(pred, pred2)
    torch.testing.assert_close(states, states2)


def test_captions_with_nothing_to_mask_add_nothing_and_are_counted():
    torch.manual_seed(0)
    model = M3AE(**TINY)
    images, tokens = _batch(model, ["", ""])
    out = model(images, tokens)
    assert out.text_count == 0 and out.text_loss == 0 and out.captions_without_target == 2
    assert torch.isfinite(out.loss) and out.loss == out.image_loss
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("key, value", [("image_mask_ratio", 1.0), ("image_mask_ratio", 0.0),
                                        ("text_mask_ratio", 1.0), ("text_mask_ratio", -0.1),
                                        ("text_loss_weight", -1.0)])
def test_bad_settings_are_refused_naming_the_key(key, value):
    with pytest.raises(ValueError, match=f"model.{key} must be"):
        M3AE(**TINY, **{key: value})


def test_validation_masks_follow_the_sample_not_the_batch():
    """Validation sums over two samples batched equal those of each sample alone."""
    torch.manual_seed(0)
    model = M3AE(**TINY).eval()
    images, tokens = _batch(model, ["a dog on the grass near a tree by the river",
                                    "two red cars parked in a long city street at night"])
    sums = []
    for rows in ([0], [1], [0, 1]):
        model.validation_step({"image": images[rows], "text": tokens[rows]}, 0)
        metrics = (model.val_image_loss, model.val_text_loss, model.val_token_top1)
        sums.append(torch.stack([m.mean_value for m in metrics] + [model.val_text_loss.weight]))  # sums, tokens
        for metric in metrics:
            metric.reset()
    torch.testing.assert_close(sums[0] + sums[1], sums[2])
    assert sums[2][3] == 9 + 9  # 11 words each, int(11 * 0.25) = 2 kept


def test_its_checkpoints_are_not_taken_for_another_kind():
    """Its weights have an MAE's marks (encoder.* + decoder.*-like) too: the table's more specific
    row (checkpoints.layouts.KINDS) names them M3AE, never MAE, which would load them into the wrong class."""
    from mmssl.checkpoints.layouts import detect_kind

    assert detect_kind(M3AE(**TINY).state_dict()).name == "M3AE"


def test_fsdp2_units_are_the_encoder_and_decoder_blocks():
    from mmssl.sharding import shard_units

    model = M3AE(**TINY)
    assert shard_units(model) == [*model.encoder.blocks, *model.mm_decoder.blocks]
