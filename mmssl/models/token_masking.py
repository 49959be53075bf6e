"""Masking of caption tokens: BERT's 80/10/10 corruption and MAE-style dropping (M3AE).

Two pure functions over (B, T) token ids, beside :mod:`mmssl.models.masking` (image patches):

* :func:`bert_masking`: BERT (Devlin et al. 2018, sec. 3.1 "Task #1: Masked LM";
  google-research/bert ``create_pretraining_data.py`` ``create_masked_lm_predictions``): choose
  ``ratio`` of each caption's maskable tokens, replace 80% of those by a mask token, 10% by a
  random token, leave 10%; the model predicts every chosen token from both sides.
* :func:`random_token_masking`: M3AE (Geng et al. 2022, sec. 3; ``m3ae/model.py``
  ``random_masking``): the encoder sees a random subset of each caption's tokens and the decoder
  predicts the removed ones, as MAE does with patches (mask convention "0 keep, 1 remove").

Tokens that are never masked (start/end-of-text) and padding are arguments, so any tokenizer fits.
open_clip's BPE pads with id 0, which is also the token "!": :func:`padding_after_eot` finds the
padding by position instead. :func:`masked_token_ce` scores the predictions of either.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # torch cross_entropy's default ignore_index: a label that is no target


def check_share(key: str, value: float, low: float = 0.0, high: float = 1.0, high_open: bool = False) -> None:
    """Refuse a ratio or share outside [low, high] (or [low, high)), naming the config key.

    Raises:
        ValueError: naming ``key`` and the range.
    """
    inside = low <= value < high if high_open else low <= value <= high
    if not inside:
        bracket = ")" if high_open else "]"
        raise ValueError(f"{key} must be in [{low}, {high}{bracket}, got {value}")


def padding_after_eot(tokens: torch.Tensor, eot_id: int) -> torch.Tensor:
    """(B, T) True at the positions after each caption's first end-of-text token.

    open_clip's tokenizers put ``eot_id`` after the text and fill with 0, a real BPE id ("!"),
    so padding is told by position, not by id. A caption without ``eot_id`` has no padding.
    """
    eot = (tokens == eot_id).to(torch.int64)  # (B, T)
    return (eot.cumsum(dim=1) - eot) > 0  # strictly after the first EOT


def maskable_tokens(
    tokens: torch.Tensor, never_masked: Sequence[int] = (), padding: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """(B, T) True where a token may be masked: not padding and not one of ``never_masked``."""
    keep = torch.zeros_like(tokens, dtype=torch.bool) if padding is None else padding.clone()
    for token_id in never_masked:
        keep |= tokens == token_id
    return ~keep


def _ranked(maskable: torch.Tensor, noise: torch.Tensor, never_first: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Argsort key: maskable tokens by their noise in [0, 1), ``never_first`` at -1, others at 2."""
    key = torch.where(maskable, noise, torch.full_like(noise, 2.0))
    if never_first is not None:
        key = torch.where(never_first, torch.full_like(noise, -1.0), key)
    return torch.argsort(key, dim=1)  # (B, T): ascending, ties never split a class


class BertMasking(NamedTuple):
    """The result of :func:`bert_masking`.

    Attributes:
        input_ids: (B, T) the corrupted captions the model reads.
        labels: (B, T) the original id where chosen, ``IGNORE_INDEX`` elsewhere.
        selected: (B, T) bool, the chosen tokens (the loss is on these only).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    selected: torch.Tensor


def bert_masking(
    tokens: torch.Tensor,
    mask_token_id: int,
    vocab_size: int,
    ratio: float = 0.15,
    mask_share: float = 0.8,
    random_share: float = 0.1,
    never_masked: Sequence[int] = (),
    padding: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
    noise: Optional[torch.Tensor] = None,
) -> BertMasking:
    """BERT's masked-LM corruption of a batch of captions.

    As ``create_masked_lm_predictions``: each caption with n maskable tokens has exactly
    ``max(1, round(n * ratio))`` of them chosen (none when n = 0); each chosen token becomes
    ``mask_token_id`` with probability ``mask_share``, a uniform random id of the vocabulary with
    ``random_share``, and stays itself otherwise (BERT: 0.8 / 0.1 / 0.1).

    Args:
        tokens: (B, T) token ids.
        mask_token_id: the id written over 80% of the chosen tokens.
        vocab_size: random replacements are drawn from [0, vocab_size).
        ratio: share of maskable tokens chosen, in (0, 1].
        mask_share: share of chosen tokens replaced by the mask token, in [0, 1].
        random_share: share replaced by a random token, in [0, 1 - mask_share].
        never_masked: ids never chosen (start/end-of-text, pad).
        padding: (B, T) True at padding positions, never chosen (:func:`padding_after_eot`).
        generator: RNG for reproducible masks.
        noise: (B, T, 3) uniforms in [0, 1) to draw from instead of ``generator``: the choice
            order, the 80/10/10 draw and the random id (``floor(u * vocab_size)``), so masks can be
            a function of the sample (validation) or of its global index (exact across world sizes).

    Returns:
        :class:`BertMasking` of (B, T) tensors.
    """
    check_share("ratio", ratio, 0.0, 1.0)
    if ratio == 0.0:
        raise ValueError("ratio must be in (0, 1], got 0.0: nothing would be predicted")
    check_share("mask_share", mask_share)
    check_share("random_share", random_share, 0.0, 1.0 - mask_share)
    maskable = maskable_tokens(tokens, never_masked, padding)  # (B, T)
    if noise is None:
        noise = torch.rand((*tokens.shape, 3), device=tokens.device, generator=generator)  # (B, T, 3)
    elif noise.shape != (*tokens.shape, 3):
        raise ValueError(f"noise must be (B, T, 3) = {(*tokens.shape, 3)}, got {tuple(noise.shape)}")
    order = _ranked(maskable, noise[..., 0])  # maskable first, in random order
    count = maskable.sum(dim=1)  # (B,)
    chosen = torch.where(count > 0, (count.float() * ratio).round().clamp_min(1), 0).to(torch.int64)  # (B,)
    rank = torch.argsort(order, dim=1)  # (B, T) each token's place in the random order
    selected = (rank < chosen.unsqueeze(1)) & maskable
    draw = noise[..., 1]  # (B, T)
    random_ids = (noise[..., 2] * vocab_size).to(torch.int64).clamp_max(vocab_size - 1)  # (B, T) uniform ids
    to_mask = selected & (draw < mask_share)
    to_random = selected & (draw >= mask_share) & (draw < mask_share + random_share)
    input_ids = torch.where(to_mask, torch.full_like(tokens, mask_token_id), tokens)
    input_ids = torch.where(to_random, random_ids, input_ids)
    labels = torch.where(selected, tokens, torch.full_like(tokens, IGNORE_INDEX))
    return BertMasking(input_ids, labels, selected)


class TokenMasking(NamedTuple):
    """The result of :func:`random_token_masking` (MAE's names and convention).

    Attributes:
        ids_keep: (B, K) indices of the kept tokens, in shuffled order; K is the most any caption
            keeps, and a caption keeping fewer fills its row with slots ``keep_valid`` marks off.
        ids_restore: (B, T) the inverse permutation, to put decoder tokens back in caption order.
        mask: (B, T) float, 1 = removed maskable token (a target), 0 = otherwise (kept, never
            masked, padding).
        keep_valid: (B, K) bool, True where ``ids_keep`` names a kept token (attention keys).
    """

    ids_keep: torch.Tensor
    ids_restore: torch.Tensor
    mask: torch.Tensor
    keep_valid: torch.Tensor


def random_token_masking(
    tokens: torch.Tensor,
    mask_ratio: float,
    never_masked: Sequence[int] = (),
    padding: Optional[torch.Tensor] = None,
    generator: Optional[torch.Generator] = None,
    noise: Optional[torch.Tensor] = None,
) -> TokenMasking:
    """Drop a random ``mask_ratio`` of each caption's maskable tokens, MAE-style.

    A caption with n maskable tokens keeps ``int(n * (1 - mask_ratio))`` of them (MAE's
    ``len_keep``, per caption) and all its never-masked tokens; padding is neither kept nor a
    target. Captions keep different numbers, so kept rows are padded to the longest and
    ``keep_valid`` tells real slots from filler (M3AE carries a padding mask the same way).

    Args:
        tokens: (B, T) token ids.
        mask_ratio: share of maskable tokens removed, in [0, 1).
        never_masked: ids always kept (start/end-of-text).
        padding: (B, T) True at padding positions (:func:`padding_after_eot`).
        generator: RNG for reproducible masks.
        noise: (B, T) uniform noise to rank the tokens by instead (``masking.sample_noise``).

    Returns:
        :class:`TokenMasking`: ``ids_keep`` (B, K), ``ids_restore`` (B, T), ``mask`` (B, T),
        ``keep_valid`` (B, K).
    """
    check_share("mask_ratio", mask_ratio, high_open=True)
    maskable = maskable_tokens(tokens, never_masked, padding)  # (B, T)
    always = ~maskable if padding is None else ~maskable & ~padding  # never-masked, not padding
    if noise is None:
        noise = torch.rand(tokens.shape, device=tokens.device, generator=generator)  # (B, T)
    ids_shuffle = _ranked(maskable, noise, always)  # always-kept, then maskable by noise, then padding
    ids_restore = torch.argsort(ids_shuffle, dim=1)  # (B, T) each token's place in the shuffle
    kept = always.sum(dim=1) + (maskable.sum(dim=1).float() * (1.0 - mask_ratio)).to(torch.int64)  # (B,)
    width = int(kept.max()) if kept.numel() else 0  # K: one host sync per batch
    ids_keep = ids_shuffle[:, :width]  # (B, K)
    keep_valid = torch.arange(width, device=tokens.device).unsqueeze(0) < kept.unsqueeze(1)  # (B, K)
    mask = ((ids_restore >= kept.unsqueeze(1)) & maskable).float()  # (B, T) in caption order
    return TokenMasking(ids_keep, ids_restore, mask, keep_valid)


def masked_token_ce(
    logits: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summed cross-entropy and top-1 hits over the target tokens, and their count.

    Sums rather than a mean, so a batch (or a caption) without a target adds 0 to both and a
    mean over any set is ``sum / count`` (no 0/0 NaN; sums and counts reduce over ranks).

    Args:
        logits: (N, V) predictions at N positions.
        labels: (N,) target ids, ``IGNORE_INDEX`` where there is no target.

    Returns:
        ``(ce_sum, correct, count)``: scalar float, scalar int64, scalar int64.
    """
    target = labels != IGNORE_INDEX  # (N,)
    ce_sum = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    correct = ((logits.argmax(dim=-1) == labels) & target).sum()
    return ce_sum, correct, target.sum()


class MaskVocabulary(NamedTuple):
    """What :func:`bert_masking` needs to know of a tokenizer (:func:`mask_vocabulary`).

    Attributes:
        mask_id: the id written over the chosen tokens.
        random_vocab: random replacements are drawn from [0, random_vocab).
        never_masked: special ids never chosen (start/end-of-text, class, pad).
        eot_id: open_clip's BPE: padding is what follows this id (it pads with 0, the token "!");
            ``None``: padding is the tokenizer's pad id, one of ``never_masked``.
    """

    mask_id: int
    random_vocab: int
    never_masked: tuple[int, ...]
    eot_id: Optional[int]


def mask_vocabulary(tokenizer, text_vocab_size: int, key: str = "model.init_args.model_name") -> MaskVocabulary:
    """The mask token and special ids of an open_clip tokenizer, for :func:`bert_masking`.

    open_clip's BPE (``SimpleTokenizer``) has no mask token: it is an added special token, the id
    one past its vocabulary (``vocab_size``), whose embedding is one more row of the text tower
    (the model config's ``text_cfg.vocab_size`` = BPE size + 1). A Hugging Face tokenizer (open_clip's
    ``HFTokenizer``) brings its own ``mask_token_id`` (BERT's ``[MASK]``).

    Args:
        tokenizer: an open_clip tokenizer (``SimpleTokenizer`` or ``HFTokenizer``).
        text_vocab_size: rows of the text tower's token embedding.
        key: the config key named in errors.

    Raises:
        ValueError: a Hugging Face tokenizer without a mask token (naming it), or a text tower
            without a row for the mask token (naming ``text_cfg.vocab_size`` and the size it needs).
    """
    hf = getattr(tokenizer, "tokenizer", None)  # HFTokenizer wraps a transformers tokenizer
    if hf is not None and hasattr(hf, "all_special_ids"):
        if getattr(hf, "mask_token_id", None) is None:
            raise ValueError(f"{key}: the tokenizer {getattr(hf, 'name_or_path', type(hf).__name__)!r} has no mask "
                             "token, so masked language modelling cannot mark the chosen tokens; use one that has "
                             "(BERT's [MASK]) or open_clip's BPE")
        mask_id, vocab = int(hf.mask_token_id), len(hf)
        never, eot = tuple(int(i) for i in hf.all_special_ids if i != mask_id), None
    else:
        mask_id = vocab = int(tokenizer.vocab_size)  # one past the BPE vocabulary: the added special token
        never, eot = (int(tokenizer.sot_token_id), int(tokenizer.eot_token_id)), int(tokenizer.eot_token_id)
    if text_vocab_size <= mask_id:
        raise ValueError(f"{key}: text_cfg.vocab_size is {text_vocab_size}, but the mask token has id {mask_id}: "
                         f"set text_cfg.vocab_size to {mask_id + 1} (one embedding row for it)")
    return MaskVocabulary(mask_id, vocab, never, eot)
