"""Image-text matching (ALBEF sec. 3.2, ``models/model_pretrain.py``): is this caption this image's?

The host's ``itm_head`` (a fusion block over the image tower's tokens and a binary head) scores the
B positive pairs and 2B hard negatives (one image per caption, one caption per image), each drawn
with probability ``softmax`` of the contrastive similarity over the other pairs of the *gathered*
batch (BLIP-2 ``blip2_qformer.py`` draws from all ranks; ALBEF from the local one), so the
negatives are those one process would draw on the concatenated batch: 2N uniforms per sample, from
the host's per-sample stream (:func:`mmssl.objectives.base.sample_uniforms`). A caption equal to
the positive's is no negative. It reads the host forward's ``image_tokens`` (B, 1+P, W).

Exact under DDP: the term is a sum over the pairs this rank fuses (its B positives, its images'
negative captions, and the captions of any rank whose negative image it holds: the ranks together
fuse one process's 3N pairs) divided by 3B (the same B on every rank). The image tokens stay on
their rank (gathering them would move N x (1+P) x W numbers, 20 GB for a ViT-B/16 at a global batch
of 32768): captions' embeddings (N, D) and chosen indices (N,) travel instead. Validation is
collective-free: each batch's hardest negatives among its own samples.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Union

import torch
import torch.nn.functional as F
from open_clip.transformer import VisionTransformer
from torch import Tensor, nn
from torchmetrics import MeanMetric

from mmssl.distributed import gather_with_grad, rank, world_size
from mmssl.errors import ConfigError
from mmssl.objectives.base import Objective, register


def pick_negatives(logits: Tensor, valid: Tensor, uniforms: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """One negative column per row: drawn with probability ``softmax(logits)`` over the valid
    columns (ALBEF's ``torch.multinomial`` of the softmaxed similarities, through the Gumbel-max
    trick), or the hardest valid one when ``uniforms`` is ``None``.

    Args:
        logits: (B, N) scaled similarities of this rank's rows to every column.
        valid: (B, N) bool, True where the column may be the row's negative.
        uniforms: (B, N) uniforms in [0, 1), or ``None``.

    Returns:
        ``(index, found)``: (B,) column indices, (B,) bool False for a row without a valid column.
    """
    scores = logits.float().masked_fill(~valid, float("-inf"))
    if uniforms is not None:
        scores = scores - torch.log(-torch.log(uniforms.float().clamp(1e-12, 1 - 1e-7)))  # + Gumbel(0, 1)
    return scores.argmax(dim=1), valid.any(dim=1)


def itm_sums(head: nn.Module, out: Mapping[str, Tensor], tokens: Tensor, uniforms: Optional[Tensor],
             gathered: bool) -> tuple[Tensor, Tensor, Tensor]:
    """ITM (CE sum, hits, count): this rank's B positives, the negative image of each caption of any
    rank whose negative image this rank holds, and the negative caption of each of its images.

    Args:
        head: (P, D) captions, (P, T, W) image tokens -> (P, 2) logits of (no match, match).
        out: the host forward's ``image_features`` (B, D), ``text_features`` (B, D), ``logit_scale``
            and ``image_tokens`` (B, 1+P, W).
        tokens: (B, L) the captions, to skip a negative whose caption is the positive's.
        uniforms: (B, 2N) for drawing (text->image, image->text); ``None``: the hardest.
        gathered: negatives from every rank's batch (training) or this rank's alone.
    """
    image, text, image_tokens = out["image_features"], out["text_features"], out["image_tokens"]
    gather = (lambda x: gather_with_grad(x, same_size=True)) if gathered else (lambda x: x)
    batch = text.shape[0]
    offset = rank() * batch if gathered else 0  # this rank's first row among the N
    all_text = gather(text)  # (N, D), gradients back to each caption's rank
    with torch.no_grad():
        all_image, all_captions = gather(image.detach()), gather(tokens)  # (N, D), (N, L)
        valid = (tokens.unsqueeze(1) != all_captions.unsqueeze(0)).any(dim=-1)  # (B, N)
        scale = out["logit_scale"].detach()
        n = all_image.shape[0]
        u_t2i, u_i2t = (None, None) if uniforms is None else (uniforms[:, :n], uniforms[:, n:])
        neg_image, has_image = pick_negatives(scale * text.detach() @ all_image.T, valid, u_t2i)  # (B,)
        neg_text, has_text = pick_negatives(scale * image.detach() @ all_text.detach().T, valid, u_i2t)
        all_neg_image = gather(torch.where(has_image, neg_image, -1))  # (N,) global index, -1: none
        held = (all_neg_image >= offset) & (all_neg_image < offset + batch)  # (N,) its image is here
        captions = held.nonzero().squeeze(1)  # (K,) global indices of those captions
    query = torch.cat([text, all_text[captions], all_text[neg_text]])  # (B + K + B, D)
    keys = torch.cat([image_tokens, image_tokens[all_neg_image[captions] - offset], image_tokens])
    logits = head(query, keys)  # (2B + K, 2)
    held_count = captions.shape[0]
    labels = torch.cat([torch.ones(batch), torch.zeros(held_count + batch)]).to(logits.device, torch.int64)
    weight = torch.cat([torch.ones(batch + held_count, device=logits.device), has_text.to(logits.dtype)])
    ce = F.cross_entropy(logits.float(), labels, reduction="none")
    hits = ((logits.argmax(dim=-1) == labels) & (weight > 0)).sum()
    return (ce * weight).sum(), hits, weight.sum()


@register
class ImageTextMatching(Objective):
    """ALBEF's matching of captions and images, by the host's ``itm_head`` over the image tokens.

    Args:
        weight: the term's weight (ALBEF: 1).
        start: see :class:`~mmssl.objectives.base.Objective`.
    """

    name = "itm"
    order = 30  # after masked words: its negatives' draws follow MLM's in each sample's stream
    host_parts = ("itm_head",)
    chunked = False  # draws its negatives from the whole batch's features

    def __init__(self, weight: float = 1.0, start: Union[int, float] = 0) -> None:
        super().__init__(weight, start)
        self.figures: dict[str, Tensor] = {}  # of the last training step: train/itm_accuracy
        self.val_loss, self.val_accuracy = MeanMetric(), MeanMetric()

    def check(self, host: nn.Module, model_name: str) -> None:
        if not isinstance(host.model.visual, VisionTransformer):
            raise ConfigError(f"model.init_args.objectives.itm: the image tower of {model_name!r} is "
                              f"{type(host.model.visual).__name__}; ITM reads the tokens of an open_clip ViT")

    def draws(self, batch: Mapping[str, Tensor], training: bool) -> int:
        return 2 * batch["text"].shape[0] * world_size() if training else 0  # (text->image, image->text) x N

    def prepare(self, host: nn.Module, batch: Mapping[str, Tensor], uniforms: Optional[Tensor],
                training: bool) -> dict[str, Tensor]:
        return {} if uniforms is None else {"itm_uniforms": uniforms}  # (B, 2N)

    def forward(self, out: Mapping[str, Any], batch: Mapping[str, Tensor], weight: float) -> Tensor:
        tokens = batch["text"]
        itm_sum, hits, count = itm_sums(self.host.itm_head, out, tokens, batch.get("itm_uniforms"), gathered=True)
        itm = itm_sum / (3 * tokens.shape[0])  # the same B on every rank: the mean over ranks is global
        self.figures = {"itm_accuracy": hits.float() / count}
        return weight * itm

    def validation(self, out: Mapping[str, Tensor], batch: Mapping[str, Tensor]) -> Tensor:
        tokens = batch["text"]
        itm_sum, hits, count = itm_sums(self.host.itm_head, out, tokens, None, gathered=False)
        itm = itm_sum / (3 * tokens.shape[0])
        self.val_loss.update(itm.detach(), weight=tokens.shape[0])
        self.val_accuracy.update(hits.float() / count.clamp_min(1), weight=count)
        return itm

    def log_training(self, module: Any) -> None:
        module.log("train/itm_accuracy", self.figures["itm_accuracy"])

    def log_validation(self, module: Any) -> None:
        module.log("val/itm_loss", self.val_loss)  # unweighted: the CE mean over the 3B pairs
        module.log("val/itm_accuracy", self.val_accuracy)
