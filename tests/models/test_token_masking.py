"""Caption token masking (mmssl.models.token_masking): BERT's 80/10/10 and M3AE's dropping, as
statistics over many constructed tokens."""

from __future__ import annotations

import pytest
import torch

from mmssl.models.token_masking import (
    IGNORE_INDEX,
    bert_masking,
    masked_token_ce,
    padding_after_eot,
    random_token_masking,
)

SOT, EOT, MASK, VOCAB = 1, 2, 3, 1000


def _captions(batch: int = 400, length: int = 40, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """SOT, random words (ids >= 10) of random lengths 0..length-3, EOT, then 0 padding (id 0)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.zeros(batch, length, dtype=torch.int64)
    for row in range(batch):
        n = int(torch.randint(0, length - 1, (1,), generator=g))
        tokens[row, 0] = SOT
        tokens[row, 1:1 + n] = torch.randint(10, VOCAB, (n,), generator=g)
        tokens[row, 1 + n] = EOT
    return tokens, padding_after_eot(tokens, EOT)


def test_padding_is_what_follows_the_first_eot_even_where_0_is_a_word():
    tokens = torch.tensor([[SOT, 0, 7, EOT, 0, 0], [SOT, 5, 6, 7, 8, 9]])
    assert padding_after_eot(tokens, EOT).tolist() == [[False] * 4 + [True] * 2, [False] * 6]


def test_bert_chooses_the_ratio_and_splits_80_10_10():
    tokens, padding = _captions()
    out = bert_masking(tokens, MASK, VOCAB, 0.15, never_masked=(SOT, EOT), padding=padding,
                       generator=torch.Generator().manual_seed(1))
    maskable = ~padding & (tokens != SOT) & (tokens != EOT)
    counts = maskable.sum(1)
    chosen = out.selected.sum(1)
    # BERT's create_masked_lm_predictions: exactly max(1, round(0.15 n)) per caption with n > 0.
    expected = torch.where(counts > 0, (counts.float() * 0.15).round().clamp_min(1), 0).long()
    assert torch.equal(chosen, expected)
    assert abs(chosen.sum() / counts.sum() - 0.15) < 0.03
    assert not (out.selected & ~maskable).any()  # SOT, EOT and padding never chosen
    sel = out.selected
    masked = (out.input_ids[sel] == MASK).float().mean()
    unchanged = (out.input_ids[sel] == tokens[sel]).float().mean()
    randomised = 1 - masked - unchanged
    assert abs(masked - 0.8) < 0.03 and abs(unchanged - 0.1) < 0.03 and abs(randomised - 0.1) < 0.03, (
        masked, unchanged, randomised)
    assert torch.equal(out.input_ids[~sel], tokens[~sel])
    assert torch.equal(out.labels[sel], tokens[sel]) and (out.labels[~sel] == IGNORE_INDEX).all()


def test_an_all_padding_caption_has_no_target_and_adds_nothing_to_the_loss():
    tokens = torch.tensor([[SOT, EOT, 0, 0], [SOT, 11, 12, EOT]])
    padding = padding_after_eot(tokens, EOT)
    out = bert_masking(tokens, MASK, VOCAB, 0.15, never_masked=(SOT, EOT), padding=padding)
    assert not out.selected[0].any() and out.selected[1].sum() == 1
    drop = random_token_masking(tokens[:1], 0.75, (SOT, EOT), padding[:1])
    assert drop.mask.sum() == 0 and drop.keep_valid.sum() == 2  # SOT and EOT kept, nothing removed
    logits = torch.randn(4, VOCAB, requires_grad=True)
    ce, correct, count = masked_token_ce(logits, out.labels[0])
    assert ce.item() == 0 and correct == 0 and count == 0 and torch.isfinite(ce)
    ce.backward()
    assert torch.isfinite(logits.grad).all() and (logits.grad == 0).all()


def test_dropping_keeps_the_share_per_caption_and_always_the_special_tokens():
    tokens, padding = _captions(seed=2)
    out = random_token_masking(tokens, 0.75, (SOT, EOT), padding, generator=torch.Generator().manual_seed(3))
    maskable = ~padding & (tokens != SOT) & (tokens != EOT)
    n = maskable.sum(1)
    assert torch.equal(out.mask.sum(1).long(), n - (n.float() * 0.25).long())  # MAE's len_keep per caption
    assert abs(out.mask.sum() / n.sum() - 0.75) < 0.03
    assert not (out.mask.bool() & ~maskable).any()
    for row in range(tokens.shape[0]):
        kept = set(out.ids_keep[row][out.keep_valid[row]].tolist())
        removed = set(out.mask[row].nonzero().flatten().tolist())
        real = set((~padding[row]).nonzero().flatten().tolist())
        assert kept | removed == real and not kept & removed  # every real token kept or a target
        assert {0, int((tokens[row] == EOT).nonzero()[0])} <= kept  # SOT and EOT visible
    # ids_restore inverts the shuffle: ids_keep are the first K of it.
    shuffle = torch.argsort(out.ids_restore, dim=1)
    assert torch.equal(shuffle[:, :out.ids_keep.shape[1]], out.ids_keep)
    # The same noise gives the same masks; each token's chance of removal is the same.
    assert out.mask[maskable].mean() == pytest.approx(0.75, abs=0.03)


@pytest.mark.parametrize("call, key", [
    (lambda t: bert_masking(t, MASK, VOCAB, ratio=1.5), "ratio"),
    (lambda t: bert_masking(t, MASK, VOCAB, ratio=0.0), "ratio"),
    (lambda t: bert_masking(t, MASK, VOCAB, mask_share=-0.1), "mask_share"),
    (lambda t: bert_masking(t, MASK, VOCAB, mask_share=0.8, random_share=0.3), "random_share"),
    (lambda t: random_token_masking(t, 1.0), "mask_ratio"),
    (lambda t: random_token_masking(t, -0.2), "mask_ratio"),
])
def test_out_of_range_shares_are_refused_naming_the_key(call, key):
    with pytest.raises(ValueError, match=f"^{key} must be in"):
        call(torch.tensor([[SOT, 11, EOT]]))
