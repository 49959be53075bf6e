"""mmssl.models.generation.beam_search against an exhaustive search, on a stand-in for open_clip's
CoCa whose next-token log-probabilities are a seeded table of (image, position, last token): with
more beams than the tree has live prefixes, beam search must return each image's caption of the
best length-normalised score (``sum log p / length ** length_penalty``), with no end-of-text
before ``min_seq_len`` tokens, each image decoded with its own image tokens, padded after the end."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from mmssl.models.generation import beam_search

SOT, EOS, PAD, WORDS = 0, 1, 2, (3, 4)
VOCAB, LONGEST = 5, 3  # captions of at most 3 words: from position 4 on, end-of-text is all but certain


class _Table(torch.nn.Module):
    """CoCa's two calls: ``model(images)`` encodes (the image's id rides in its tokens) and
    ``model(None, text, image_latent=, image_embs=, output_labels=False)`` gives next-token logits."""

    def __init__(self, images: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        logits = torch.full((images, LONGEST + 3, VOCAB, VOCAB), -30.0)  # (image, position, last, next)
        logits[:, : LONGEST + 1, :, [EOS, *WORDS]] = 1.5 * torch.randn(images, LONGEST + 1, VOCAB, 3, generator=g)
        logits[:, LONGEST + 1:, :, EOS] = 0.0
        self.logits = logits
        self.calls: list[torch.Tensor] = []  # the prefixes of every decoding step

    def forward(self, images, text=None, image_latent=None, image_embs=None, output_labels=True):
        if text is None:
            ids = images.float()[:, None]  # (B, 1)
            return {"image_features": ids, "image_embs": ids[:, None, :].expand(-1, 3, -1)}  # (B, D), (B, Q, W)
        self.calls.append(text.clone())
        image = image_embs[:, 0, 0].long()  # (B*K,)
        out = torch.zeros(text.shape[0], text.shape[1], VOCAB)
        out[:, -1] = self.logits[image, text.shape[1], text[:, -1]]
        return {"logits": out}  # (B*K, t, V)

    def log_probs(self, image: int, position: int, last: int) -> torch.Tensor:
        return F.log_softmax(self.logits[image, position, last], dim=-1)


def _exhaustive(model: _Table, image: int, min_seq_len: int, length_penalty: float) -> list[int]:
    best, best_score = None, -float("inf")
    for n in range(max(0, min_seq_len - 1), LONGEST + 1):
        for words in itertools.product(WORDS, repeat=n):
            caption = [SOT, *words, EOS]
            total = sum(float(model.log_probs(image, t, caption[t - 1])[caption[t]]) for t in range(1, len(caption)))
            score = total / (len(caption) - 1) ** length_penalty
            if score > best_score:
                best, best_score = caption, score
    return best


@pytest.mark.parametrize("min_seq_len", [1, 3])
def test_beam_search_finds_each_images_best_length_normalised_caption(min_seq_len):
    model, images = _Table(6, seed=0), torch.arange(6)
    found = {}
    for length_penalty in (0.0, 1.0, 2.0):
        want = [_exhaustive(model, i, min_seq_len, length_penalty) for i in range(6)]
        got = beam_search(model, images, SOT, EOS, PAD, num_beams=16, seq_len=LONGEST + 3, min_seq_len=min_seq_len,
                          length_penalty=length_penalty)
        width = max(len(c) for c in want)
        assert got.tolist() == [c + [PAD] * (width - len(c)) for c in want], length_penalty
        found[length_penalty] = want
    # the table is one where the normalisation and the images matter
    assert len({tuple(c) for c in found[1.0]}) > 2 and (found[0.0] != found[1.0]) == (min_seq_len == 1)
    assert any(len(c) - 2 < 2 for c in found[0.0]) == (min_seq_len == 1)  # a caption of < 2 words wins at 1


def test_every_step_keeps_num_beams_distinct_live_prefixes_per_image():
    """Two beams: the first step starts from one live beam (not two copies of the start token), and
    every step keeps two live prefixes, however many of the best candidates ended."""
    model, images, beams = _Table(4, seed=1), torch.arange(4), 2
    beam_search(model, images, SOT, EOS, PAD, num_beams=beams, seq_len=LONGEST + 3, min_seq_len=1)
    assert len(model.calls) >= 3
    for text in model.calls[1:]:
        for rows in text.reshape(4, beams, -1):  # (K, t) of one image
            assert (rows[:, 0] == SOT).all() and not torch.equal(rows[0], rows[1]), text


def test_the_search_goes_on_while_a_live_beam_can_still_beat_the_finished_ones():
    """transformers' rule compares a finished caption with the best live beam's normalised score:
    "<end>" (log 0.45 = -0.80) against the live "a" (log 0.3 / 2 = -0.60) goes on (unnormalised,
    -1.20, it would stop), and "a <end>" (-0.60) wins."""
    model = _Table(1, seed=0)
    model.logits[0, 1, SOT, [EOS, *WORDS]] = torch.tensor([0.45, 0.3, 0.25]).log()
    model.logits[0, 2:] = -30.0
    model.logits[0, 2:, :, EOS] = 0.0
    got = beam_search(model, torch.arange(1), SOT, EOS, PAD, num_beams=1, seq_len=6, min_seq_len=1)
    assert got.tolist() == [[SOT, WORDS[0], EOS]]


@pytest.mark.parametrize("num_beams", [1, 2])
def test_a_caption_cut_at_seq_len_is_scored_with_its_end_of_text(num_beams):
    """At ``seq_len`` a live beam ends with end-of-text, scored with that token's log-probability:
    "a <end>" (log 0.35 + log 0.01) / 2 = -2.83 loses to "<end>" (log 0.4 = -0.92). Scored with
    its likeliest next word (0.6) in the end's place, "a <end>" (-0.78) won."""
    model = _Table(1, seed=0)
    model.logits[0] = -30.0
    model.logits[0, 1, SOT, [EOS, *WORDS]] = torch.tensor([0.4, 0.35, 0.25]).log()
    model.logits[0, 2, :, [EOS, *WORDS]] = torch.tensor([0.01, 0.6, 0.39]).log()
    got = beam_search(model, torch.arange(1), SOT, EOS, PAD, num_beams=num_beams, seq_len=3, min_seq_len=1)
    assert got.tolist() == [[SOT, EOS]]
    # Normalised by its 2 tokens: "a <end>" (log 0.35 + log 0.86) / 2 = -0.60 loses to "<end>"
    # (log 0.607 = -0.50) by a little; divided by 3, it (-0.40) would win.
    model.logits[0, 1, SOT, [EOS, *WORDS]] = torch.tensor([0.607, 0.35, 0.043]).log()
    model.logits[0, 2, :, [EOS, *WORDS]] = torch.tensor([0.861, 0.1, 0.039]).log()
    got = beam_search(model, torch.arange(1), SOT, EOS, PAD, num_beams=num_beams, seq_len=3, min_seq_len=1)
    assert got.tolist() == [[SOT, EOS]]
    model.logits[0, 1, SOT, EOS] = torch.tensor(0.5).log()  # log 0.5 = -0.69: now the cut caption wins
    got = beam_search(model, torch.arange(1), SOT, EOS, PAD, num_beams=num_beams, seq_len=3, min_seq_len=1)
    assert got.tolist() == [[SOT, WORDS[0], EOS]]
