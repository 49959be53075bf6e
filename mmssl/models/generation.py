"""Caption generation with an open_clip ``CoCa``: open_clip's sampling, and a beam search.

``top_k`` / ``top_p`` run open_clip's own ``CoCa.generate`` loop (made to work under transformers 5
by :func:`mmssl.upstream.open_clip_coca_sampling`). ``beam_search`` is written here: open_clip 3.3's
``_generate_beamsearch`` is built on transformers' ``BeamSearchScorer``, which transformers 5
removed (its beam search now lives inside ``GenerationMixin``, which a CoCa is not). It is plain
beam search (no beam groups) with transformers' length-normalised scores
(``sum log p / length ** length_penalty``) and its stopping rule, over CoCa's public
``forward(image, text, image_latent=, image_embs=, output_labels=False)``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mmssl.upstream import open_clip_coca_sampling

GENERATION_TYPES: tuple[str, ...] = ("beam_search", "top_p", "top_k")


@torch.no_grad()
def beam_search(model: nn.Module, images: Tensor, sot_token_id: int, eos_token_id: int, pad_token_id: int,
                num_beams: int = 6, seq_len: int = 30, min_seq_len: int = 5, length_penalty: float = 1.0) -> Tensor:
    """The most likely caption of each image under ``model`` (an open_clip ``CoCa``), by beam search.

    Args:
        model: open_clip ``CoCa`` (in eval mode).
        images: (B, 3, H, W).
        sot_token_id: start-of-text id every caption starts with.
        eos_token_id: end-of-text id; a beam that emits it is finished.
        pad_token_id: fills the output after each caption's end.
        num_beams: beams kept per image.
        seq_len: longest output, start token included (open_clip's ``seq_len``).
        min_seq_len: no end-of-text before a sequence has this many tokens (open_clip's rule).
        length_penalty: exponent of the length that divides a finished beam's log-probability.

    Returns:
        (B, T) token ids, ``T <= seq_len``: start token, caption, end-of-text, then padding.
    """
    if num_beams < 1 or seq_len < 2:
        raise ValueError(f"beam search needs num_beams >= 1 and seq_len >= 2, got {num_beams}, {seq_len}")
    batch, k = images.shape[0], num_beams
    encoded = model(images)  # {"image_features": (B, D), "image_embs": (B, Q, W)}
    latent = encoded["image_features"].repeat_interleave(k, dim=0)  # (B*K, D)
    embs = encoded["image_embs"].repeat_interleave(k, dim=0)  # (B*K, Q, W)
    seqs = torch.full((batch * k, 1), sot_token_id, dtype=torch.long, device=images.device)  # (B*K, t)
    scores = torch.full((batch, k), float("-inf"), device=images.device)
    scores[:, 0] = 0.0  # one live beam at the start, so the first step does not pick K copies
    done: list[list[tuple[float, Tensor]]] = [[] for _ in range(batch)]  # per image: (score, sequence)
    for _ in range(seq_len - 1):
        logits = model(None, seqs, image_latent=latent, image_embs=embs, output_labels=False)["logits"][:, -1]
        logp = F.log_softmax(logits.float(), dim=-1)  # (B*K, V)
        if seqs.shape[1] + 1 == seq_len:
            # The caption is cut here: each live beam ends with end-of-text, scored with that token's
            # log-probability (open_clip's sampling also writes end-of-text at seq_len). Ending a beam
            # on each of its best next tokens with end-of-text written in its place scored a caption
            # by a word it does not hold, and kept the same caption once per such token.
            ended_scores = scores.reshape(-1) + logp[:, eos_token_id]  # (B*K,)
            ends = torch.cat([seqs, seqs.new_full((seqs.shape[0], 1), eos_token_id)], dim=1)  # (B*K, seq_len)
            for b in range(batch):
                for i in range(b * k, (b + 1) * k):
                    if float(scores.reshape(-1)[i]) > float("-inf"):
                        done[b].append((float(ended_scores[i]) / (seq_len - 1) ** length_penalty, ends[i]))
                done[b] = sorted(done[b], key=lambda d: -d[0])[:k]
            break
        if seqs.shape[1] < min_seq_len:
            logp[:, eos_token_id] = float("-inf")
        vocab = logp.shape[1]
        cand = (scores.reshape(-1, 1) + logp).reshape(batch, k * vocab)  # (B, K*V)
        top, index = cand.topk(2 * k, dim=1)  # (B, 2K): enough to keep K live beams after EOS picks
        new_seqs, new_scores = (
            seqs.new_full((batch, k, seqs.shape[1] + 1), pad_token_id),
            torch.full_like(scores, float("-inf")),
        )
        for b in range(batch):
            kept = 0
            for score, idx in zip(top[b].tolist(), index[b].tolist()):
                beam, token = divmod(idx, vocab)
                if score == float("-inf"):
                    break
                prefix = seqs[b * k + beam]
                if token == eos_token_id:
                    ended = torch.cat([prefix, prefix.new_tensor([eos_token_id])])
                    done[b].append((score / (ended.shape[0] - 1) ** length_penalty, ended))
                elif kept < k:
                    new_seqs[b, kept, :-1], new_seqs[b, kept, -1] = prefix, token
                    new_scores[b, kept] = score
                    kept += 1
            done[b] = sorted(done[b], key=lambda d: -d[0])[:k]
        seqs, scores = new_seqs.reshape(batch * k, -1), new_scores
        # transformers' stopping rule (early_stopping=False): an image is done when it has K
        # finished beams and its best live beam, at the current length, cannot beat the worst.
        best_live = scores.max(dim=1).values / seqs.shape[1] ** length_penalty
        if all(len(d) == k and d[-1][0] >= float(best_live[b]) for b, d in enumerate(done)):
            break
    chosen = [d[0][1] if d else seqs[b * k] for b, d in enumerate(done)]
    out = seqs.new_full((batch, max(c.shape[0] for c in chosen)), pad_token_id)
    for b, c in enumerate(chosen):
        out[b, : c.shape[0]] = c
    return out


def generate(model: nn.Module, images: Tensor, generation_type: str, sot_token_id: int, eos_token_id: int,
             pad_token_id: int, **params: Any) -> Tensor:
    """Captions of ``images`` as token ids: ``beam_search`` (:func:`beam_search`) or open_clip's
    ``CoCa.generate`` for ``top_p`` / ``top_k`` sampling (its ``top_p``, ``top_k``, ``temperature``,
    ``seq_len``, ``min_seq_len``, ``repetition_penalty``, ...).

    Returns:
        (B, T) token ids starting with ``sot_token_id``.
    """
    if generation_type not in GENERATION_TYPES:
        raise ValueError(f"generation type {generation_type!r} is not one of {list(GENERATION_TYPES)}")
    if generation_type == "beam_search":
        return beam_search(model, images, sot_token_id, eos_token_id, pad_token_id, **params)
    open_clip_coca_sampling()
    return model.generate(images, generation_type=generation_type, sot_token_id=sot_token_id,
                          eos_token_id=eos_token_id, pad_token_id=pad_token_id, **params)
