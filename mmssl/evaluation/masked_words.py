"""Masked attribute words with the true image and with a blank one: does the text side read the image?

Issue-style cross-modal check on the demo set (:mod:`mmssl.data.demo`), whose captions name each
scene's colour and shape: the colour (or shape) word of a held-out caption is masked and predicted
by a model with ``predict_masked_tokens(images, tokens, positions) -> (B, V) logits`` (M3AE,
CLIP + MLM), once with the caption's own image and once with a blank image. The rest of the caption
(size, position, background, the other attribute) does not tell the masked word, so accuracy above
the blank image's is what the model read from the pixels. The blank image is the data set's mean
colour, which after normalisation by that mean is all zeros.

Top-1 is taken among the attribute's words (6 colours or 6 shapes: chance 1/6) and, stricter, over
the whole vocabulary. Pure functions: no collective, one process.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import Tensor, nn

from mmssl.data.demo import COLORS, SHAPES
from mmssl.evaluation.features import frozen_eval

DEMO_ATTRIBUTES: dict[str, tuple[str, ...]] = {"color": tuple(COLORS), "shape": SHAPES}


def word_ids(tokenizer: Any, words: Sequence[str]) -> list[int]:
    """The single BPE id of each word (open_clip ``SimpleTokenizer.encode``).

    Raises:
        ValueError: a word that is not one token, naming it (its position could not be masked alone).
    """
    ids = []
    for word in words:
        encoded = tokenizer.encode(word)
        if len(encoded) != 1:
            raise ValueError(f"attribute word {word!r} is {len(encoded)} tokens {encoded}, not one: it cannot be "
                             "masked as one word")
        ids.append(int(encoded[0]))
    return ids


def attribute_positions(tokens: Tensor, ids: Sequence[int]) -> Tensor:
    """(N, T) captions -> (N,) position of the first token among ``ids``, -1 where none occurs."""
    hit = torch.isin(tokens, torch.tensor(list(ids), device=tokens.device))  # (N, T)
    first = hit.to(torch.int64).argmax(dim=1)  # (N,) first True (0 when none)
    return torch.where(hit.any(dim=1), first, torch.full_like(first, -1))


def blank_images(images: Tensor) -> Tensor:
    """Images of the data's mean colour, normalised: zeros of ``images``' shape and dtype."""
    return torch.zeros_like(images)


@torch.no_grad()
def _hits(model: nn.Module, images: Tensor, tokens: Tensor, positions: Tensor, ids: Tensor,
          batch_size: int) -> tuple[int, int]:
    """(hits among ``ids``, hits over the vocabulary) of the masked words."""
    among, full = 0, 0
    for start in range(0, images.shape[0], batch_size):
        sl = slice(start, start + batch_size)
        rows = torch.arange(tokens[sl].shape[0], device=tokens.device)
        target = tokens[sl][rows, positions[sl]]  # (b,)
        logits = model.predict_masked_tokens(images[sl], tokens[sl], positions[sl]).float()  # (b, V)
        among += int((ids[logits[:, ids].argmax(dim=1)] == target).sum())
        full += int((logits.argmax(dim=1) == target).sum())
    return among, full


def masked_word_accuracy(
    model: nn.Module,
    images: Tensor,
    tokens: Tensor,
    attributes: Mapping[str, Sequence[str]] = DEMO_ATTRIBUTES,
    batch_size: int = 64,
) -> dict[str, dict[str, float]]:
    """Top-1 of each masked attribute word with the true image and with a blank one.

    Args:
        model: has ``predict_masked_tokens(images, tokens, positions)`` and ``tokenizer`` (``encode``);
            left in its original mode.
        images: (N, 3, H, W) normalised held-out images, on the model's device.
        tokens: (N, T) their captions' ids (the model's tokenizer).
        attributes: name -> its words, each one token (default: the demo's colours and shapes).
        batch_size: captions per forward.

    Returns:
        Per attribute: ``count`` (captions naming one of its words; the others are skipped),
        ``top1_image``, ``top1_blank`` (among the attribute's words), ``gap`` (their difference),
        ``top1_image_vocab``, ``top1_blank_vocab`` (over the whole vocabulary), ``chance``.

    Raises:
        ValueError: a model without ``predict_masked_tokens``, images and captions of different
            counts, or a word that is not one token.
    """
    if not hasattr(model, "predict_masked_tokens"):
        raise ValueError(f"{type(model).__name__} has no predict_masked_tokens: masked words need an M3AE or "
                         "CLIP + MLM model")
    if images.shape[0] != tokens.shape[0]:
        raise ValueError(f"{images.shape[0]} images but {tokens.shape[0]} captions")
    report = {}
    with frozen_eval(model):
        for name, words in attributes.items():
            ids = torch.tensor(word_ids(model.tokenizer, words), device=tokens.device)
            positions = attribute_positions(tokens, ids.tolist())
            found = positions >= 0
            count = int(found.sum())
            imgs, toks, pos = images[found], tokens[found], positions[found]
            true_hits = _hits(model, imgs, toks, pos, ids, batch_size)
            blank_hits = _hits(model, blank_images(imgs), toks, pos, ids, batch_size)
            share = (lambda h: h / count) if count else (lambda h: 0.0)
            report[name] = {
                "count": count, "top1_image": share(true_hits[0]), "top1_blank": share(blank_hits[0]),
                "gap": share(true_hits[0]) - share(blank_hits[0]),
                "top1_image_vocab": share(true_hits[1]), "top1_blank_vocab": share(blank_hits[1]),
                "chance": 1.0 / len(words),
            }
    return report
