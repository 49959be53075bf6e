"""The captioning objective (CoCa, Yu et al. 2022, sec. 3.2 eq. 4; LocCa's captioning in SigLIP 2):
teacher-forced next-token cross-entropy of a decoder that reads the image tokens.

It needs a model with a caption decoder (``text_decoder``: open_clip's ``CoCa`` builds one from any
config with a ``multimodal_cfg``) and the model's joint forward, which returns the decoder's
``logits`` (B, L-1, V) predicting ``labels`` = ``tokens[:, 1:]``. The loss is a mean over label
tokens (``ignore_index`` = the padding id, open_clip's ``CoCaLoss.caption_loss``), and captions differ
in length, so the plain mean over ranks would weight a rank's tokens by 1 / (its token count): each
rank's term is rescaled by ``n_r * world / N`` (``n_r`` its tokens, ``N`` all ranks', one all-reduce
of a count per step), and the mean over ranks is then the token mean of the concatenated batch
(tested on 2 gloo processes). Under GradCache each chunk keeps its token sum of the cross-entropy,
not its (b, L-1, V) logits: per-token, so chunking leaves the loss exact.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric

from mmssl.distributed import is_distributed, world_size
from mmssl.objectives.base import Objective, register


@register
class Captioning(Objective):
    """Caption the image with the model's decoder.

    Args:
        weight: the term's weight (CoCa sec. 4.1: lambda_Cap = 2; ``open_clip_train
            --coca-caption-loss-weight`` 2.0).
        start: see :class:`~mmssl.objectives.base.Objective`.
    """

    name = "caption"
    order = 10
    parts = ("text_decoder",)
    joint = True

    def __init__(self, weight: float = 2.0, start: Union[int, float] = 0) -> None:
        super().__init__(weight, start)
        self.pad_id = 0
        self.val_loss = MeanMetric()  # per batch, weighted by its label tokens: the token mean
        self.val_token_top1 = MeanMetric()  # next-token accuracy of the teacher-forced decoder

    def bind(self, model: nn.Module) -> None:
        self.pad_id = int(getattr(model, "pad_id", 0))

    def token_mean(self, logits: Tensor, labels: Tensor) -> Tensor:
        """(B, L-1, V), (B, L-1) -> the cross-entropy's mean over the non-pad label tokens."""
        return F.cross_entropy(logits.permute(0, 2, 1), labels, ignore_index=self.pad_id)  # CE over dim 1

    def _sum(self, logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """(B, L-1, V), (B, L-1) -> (sum of the token cross-entropies, number of non-pad tokens)."""
        count = (labels != self.pad_id).sum()
        return self.token_mean(logits, labels) * count, count

    def chunk(self, out: Mapping[str, Tensor]) -> Optional[Tensor]:
        return self._sum(out["logits"], out["labels"])[0]

    def forward(self, out: Mapping[str, Any], batch: Mapping[str, Tensor], weight: float) -> Tensor:
        labels = batch["text"][:, 1:]  # (B, L-1): what the decoder predicts
        count = (labels != self.pad_id).sum()
        chunks = out.get("chunks", {}).get(self.name)
        if chunks is not None:
            caption = weight * torch.stack(chunks).sum() / count
        else:
            caption = self.token_mean(out["logits"], out["labels"]) * weight
        if is_distributed():
            total = count.detach().clone()
            dist.all_reduce(total)  # every rank's label tokens: N
            caption = caption * (count * world_size() / total)
        return caption

    def validation(self, out: Mapping[str, Tensor], batch: Mapping[str, Tensor]) -> Tensor:
        caption_sum, count = self._sum(out["logits"], out["labels"])
        caption = caption_sum / count.clamp(min=1)
        self.val_loss.update(caption.detach(), weight=count)
        mask = out["labels"] != self.pad_id
        hits = (out["logits"].argmax(dim=-1) == out["labels"])[mask].float().sum()
        self.val_token_top1.update(hits / count.clamp(min=1), weight=count)
        return caption

    def log_validation(self, module: Any) -> None:
        module.log("val/caption_loss", self.val_loss)  # the unweighted token mean
        module.log("val/caption_token_top1", self.val_token_top1)
