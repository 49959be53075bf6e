"""Caption token masking (mmssl.models.token_masking) decided token by token: given noise, each
token's fate follows BERT's and MAE's rules exactly; the ranges' ends, the refusals' words, the
padding mask left as it was, and the mask vocabulary of open_clip's BPE."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mmssl.models.token_masking import (
    IGNORE_INDEX,
    bert_masking,
    mask_vocabulary,
    maskable_tokens,
    masked_token_ce,
    random_token_masking,
)

SOT, EOT, MASK, VOCAB = 1, 2, 3, 100


def test_given_noise_each_chosen_token_is_masked_randomised_or_kept_by_its_draw():
    tokens = torch.tensor([[SOT, 11, 12, 13, 14, 15, EOT, 0]])
    padding = torch.tensor([[False] * 7 + [True]])
    noise = torch.zeros(1, 8, 3)
    # choice order (noise 0): 13, 14, 12, 15, 11 (lowest first); the SOT, EOT and padding get 0 too
    noise[0, :, 0] = torch.tensor([0.0, 0.9, 0.3, 0.1, 0.2, 0.5, 0.0, 0.0])
    noise[0, :, 1] = torch.tensor([0.0, 0.0, 0.85, 0.5, 0.95, 0.0, 0.0, 0.0])  # mask / random / keep draws
    noise[0, :, 2] = torch.tensor([0.0, 0.0, 0.999999, 0.0, 0.0, 0.0, 0.0, 0.0])  # random id: floor(u V)
    out = bert_masking(tokens, MASK, VOCAB, ratio=0.6, never_masked=(SOT, EOT), padding=padding, noise=noise)
    # 5 maskable tokens, round(0.6 * 5) = 3 chosen: 13 (masked), 14 (kept), 12 (random id 99)
    assert out.selected.tolist() == [[False, False, True, True, True, False, False, False]]
    assert out.input_ids.tolist() == [[SOT, 11, VOCAB - 1, MASK, 14, 15, EOT, 0]]
    assert out.labels.tolist() == [[IGNORE_INDEX, IGNORE_INDEX, 12, 13, 14] + [IGNORE_INDEX] * 3]
    assert padding.tolist() == [[False] * 7 + [True]]  # the caller's padding mask is not written to

    # The shares' ends: a draw at mask_share is randomised, not masked; at mask_share + random_share kept.
    edge = noise.clone()
    edge[0, :, 1] = torch.tensor([0.0, 0.0, 0.5, 0.25, 0.5, 0.0, 0.0, 0.0])  # exact in float32
    edge[0, 2:5, 2] = torch.tensor([0.5, 0.4, 0.5])
    out = bert_masking(tokens, MASK, VOCAB, ratio=0.6, mask_share=0.25, random_share=0.25, never_masked=(SOT, EOT),
                       padding=padding, noise=edge)
    assert out.input_ids.tolist() == [[SOT, 11, 12, 40, 14, 15, EOT, 0]]  # 13 randomised, 12 and 14 kept
    edge[0, :, 1] = torch.tensor([0.0, 0.0, 0.49, 0.24, 0.25, 0.0, 0.0, 0.0])
    out = bert_masking(tokens, MASK, VOCAB, ratio=0.6, mask_share=0.25, random_share=0.25, never_masked=(SOT, EOT),
                       padding=padding, noise=edge)
    assert out.input_ids.tolist() == [[SOT, 11, 50, MASK, 50, 15, EOT, 0]]

    edge[0, :, 1] = 0.5  # with no random share, a draw at mask_share keeps its token
    out = bert_masking(tokens, MASK, VOCAB, ratio=0.6, mask_share=0.5, random_share=0.0, never_masked=(SOT, EOT),
                       padding=padding, noise=edge)
    assert out.input_ids.tolist() == tokens.tolist() and out.selected.sum() == 3

    with pytest.raises(ValueError) as refused:
        bert_masking(tokens, MASK, VOCAB, noise=noise[..., :2])
    assert str(refused.value) == "noise must be (B, T, 3) = (1, 8, 3), got (1, 8, 2)"


def test_ratios_at_the_ends_of_their_ranges_are_taken():
    tokens = torch.tensor([[SOT, 11, 12, EOT]])
    every = bert_masking(tokens, MASK, VOCAB, ratio=1.0, mask_share=1.0, random_share=0.0, never_masked=(SOT, EOT))
    assert every.input_ids.tolist() == [[SOT, MASK, MASK, EOT]]
    kept = bert_masking(tokens, MASK, VOCAB, ratio=1.0, mask_share=0.0, random_share=0.0, never_masked=(SOT, EOT))
    assert kept.input_ids.tolist() == tokens.tolist() and kept.selected.sum() == 2
    bert_masking(tokens, MASK, VOCAB, mask_share=0.5, random_share=0.5)  # random_share = 1 - mask_share
    none = random_token_masking(tokens, 0.0, (SOT, EOT))
    assert none.mask.sum() == 0 and none.keep_valid.all() and none.ids_keep.shape == (1, 4)


@pytest.mark.parametrize("call, message", [
    (lambda t: bert_masking(t, MASK, VOCAB, ratio=1.5), "ratio must be in [0.0, 1.0], got 1.5"),
    (lambda t: bert_masking(t, MASK, VOCAB, ratio=0.0), "ratio must be in (0, 1], got 0.0: nothing would be predicted"),
    (lambda t: bert_masking(t, MASK, VOCAB, mask_share=1.2), "mask_share must be in [0.0, 1.0], got 1.2"),
    (lambda t: bert_masking(t, MASK, VOCAB, mask_share=0.5, random_share=0.75),
     "random_share must be in [0.0, 0.5], got 0.75"),
    (lambda t: random_token_masking(t, 1.0), "mask_ratio must be in [0.0, 1.0), got 1.0"),
])
def test_refusals_name_the_key_and_its_range(call, message):
    with pytest.raises(ValueError) as refused:
        call(torch.tensor([[SOT, 11, EOT]]))
    assert str(refused.value) == message


def test_given_noise_dropping_keeps_the_special_tokens_then_the_lowest_noise():
    tokens = torch.tensor([[SOT, 11, 12, 13, 14, EOT, 0, 0], [SOT, 21, 22, EOT, 0, 0, 0, 0]])
    padding = torch.tensor([[False] * 6 + [True] * 2, [False] * 4 + [True] * 4])
    noise = torch.tensor([[0.9, 0.4, 0.1, 0.3, 0.2, 0.9, 0.0, 0.0], [0.5, 0.6, 0.1, 0.5, 0.0, 0.0, 0.0, 0.0]])
    out = random_token_masking(tokens, 0.5, (SOT, EOT), padding, noise=noise)
    # row 0: SOT, EOT + int(4 * 0.5) = 2 of (12, 14); row 1: SOT, EOT + int(2 * 0.5) = 1: 22
    assert out.keep_valid.tolist() == [[True] * 4, [True, True, True, False]]
    assert [sorted(out.ids_keep[0].tolist()), sorted(out.ids_keep[1, :3].tolist())] == [[0, 2, 4, 5], [0, 2, 3]]
    assert out.mask.tolist() == [[0, 1, 0, 1, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0, 0, 0]]
    assert out.mask.dtype == torch.float32
    assert torch.equal(torch.gather(tokens, 1, out.ids_keep)[0, :2].sort().values, torch.tensor([SOT, EOT]))
    assert padding.sum() == 6  # not written to

    # Without a padding mask every token is real: what follows the EOT is maskable.
    plain = random_token_masking(tokens[:1], 0.5, (SOT, EOT), noise=noise[:1])
    assert plain.keep_valid.shape == (1, 5) and plain.mask.sum() == 3
    empty = random_token_masking(tokens[:0], 0.5, (SOT, EOT))
    assert empty.ids_keep.shape == (0, 0) and empty.keep_valid.shape == (0, 0)


def test_maskable_tokens_are_neither_padding_nor_special():
    tokens = torch.tensor([[SOT, 11, EOT, 0], [SOT, EOT, 0, 0]])
    padding = torch.tensor([[False, False, False, True], [False, False, True, True]])
    assert maskable_tokens(tokens, (SOT, EOT), padding).tolist() == [[False, True, False, False], [False] * 4]
    assert maskable_tokens(tokens, (SOT,)).tolist() == [[False, True, True, True], [False, True, True, True]]
    assert padding.tolist() == [[False, False, False, True], [False, False, True, True]]


def test_the_loss_sums_over_targets_and_counts_top1_hits():
    logits = torch.tensor([[4.0, 0.0, 0.0], [0.0, 4.0, 0.0], [0.0, 0.0, 4.0], [1.0, 2.0, 3.0]], dtype=torch.float16)
    labels = torch.tensor([0, 2, IGNORE_INDEX, 2])
    ce, correct, count = masked_token_ce(logits, labels)
    want = torch.nn.functional.cross_entropy(logits.float()[[0, 1, 3]], labels[[0, 1, 3]], reduction="sum")
    assert ce.dtype == torch.float32 and torch.allclose(ce, want)
    assert int(correct) == 2 and int(count) == 3  # row 2 is no target


def test_open_clips_bpe_gets_a_mask_token_one_past_its_vocabulary():
    bpe = SimpleNamespace(vocab_size=49408, sot_token_id=49406, eot_token_id=49407)
    voc = mask_vocabulary(bpe, 49409)
    assert voc == (49408, 49408, (49406, 49407), 49407)
    with pytest.raises(ValueError) as refused:
        mask_vocabulary(bpe, 49408, key="model.init_args.text")
    assert str(refused.value) == ("model.init_args.text: text_cfg.vocab_size is 49408, but the mask token has id "
                                  "49408: set text_cfg.vocab_size to 49409 (one embedding row for it)")


def test_a_generator_gives_the_masks_of_its_own_draws_whatever_the_global_rng():
    tokens = torch.randint(10, VOCAB, (4, 12), generator=torch.Generator().manual_seed(0))
    tokens[:, 0], tokens[:, -1] = SOT, EOT
    torch.manual_seed(5)
    bert = bert_masking(tokens, MASK, VOCAB, 0.5, never_masked=(SOT, EOT), generator=torch.Generator().manual_seed(1))
    drop = random_token_masking(tokens, 0.5, (SOT, EOT), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(6)  # another global state: the same masks
    noise3 = torch.rand((4, 12, 3), generator=torch.Generator().manual_seed(1))
    noise = torch.rand((4, 12), generator=torch.Generator().manual_seed(1))
    assert torch.equal(bert.input_ids, bert_masking(tokens, MASK, VOCAB, 0.5, never_masked=(SOT, EOT),
                                                    noise=noise3).input_ids)
    assert torch.equal(drop.mask, random_token_masking(tokens, 0.5, (SOT, EOT), noise=noise).mask)


def test_hugging_face_tokenizers_are_told_by_their_special_ids_and_named_when_refused():
    class Tok(list):  # a transformers tokenizer without name_or_path or mask_token_id
        all_special_ids = [0, 101, 102]

    with pytest.raises(ValueError) as refused:
        mask_vocabulary(SimpleNamespace(tokenizer=Tok(range(200))), 200)
    assert str(refused.value) == (
        "model.init_args.model_name: the tokenizer 'Tok' has no mask token, so masked language modelling cannot "
        "mark the chosen tokens; use one that has (BERT's [MASK]) or open_clip's BPE")
    # A BPE-like tokenizer with some other `tokenizer` attribute is read as open_clip's BPE.
    bpe = SimpleNamespace(tokenizer=object(), vocab_size=300, sot_token_id=298, eot_token_id=299)
    assert mask_vocabulary(bpe, 301) == (300, 300, (298, 299), 299)
    with pytest.raises(ValueError, match="^model.init_args.model_name: text_cfg.vocab_size is 300"):
        mask_vocabulary(bpe, 300)
