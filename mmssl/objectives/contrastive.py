"""The contrastive objective: CLIP's softmax InfoNCE or SigLIP's sigmoid loss, exact over ranks.

Each rank scores its own B rows against the N columns of every rank (the features gathered with
gradients, :func:`mmssl.distributed.gather_with_grad`): open_clip's ``local_loss=True,
gather_with_grad=True``. The mean over ranks of the returned losses is the loss of one process on
the concatenated batch, and Lightning's DDP averages gradients over ranks, so the update is that
of the single-process global batch (tests/test_distributed.py proves it on 2 processes). The loss
functions themselves are :func:`mmssl.losses.clip_loss` and :func:`mmssl.losses.siglip_loss`;
with ``chunk_size`` they take the N columns that many at a time and rebuild each block's logits in
the backward, so the (B, N) logits are never held whole (same loss and gradients: mmssl/losses.py
derives it, tests/objectives/test_contrastive_chunked.py checks it on 1 and 2 processes).
"""

from __future__ import annotations

import math
from typing import Any, Literal, Mapping, Optional, Union

from torch import Tensor
from torchmetrics import MeanMetric

from mmssl.distributed import gather_with_grad, rank
from mmssl.errors import ConfigError
from mmssl.losses import clip_loss, siglip_loss
from mmssl.objectives.base import Objective, register

# Initial (logit_scale, logit_bias): CLIP sec. 2.5 (temperature 0.07, no bias); SigLIP sec. 3.2
# (t' = log 10, b = -10, so training starts near the prior of mostly negative pairs).
LOSS_INIT: dict[str, tuple[float, Optional[float]]] = {
    "clip": (math.log(1 / 0.07), None),
    "siglip": (math.log(10.0), -10.0),
}


def contrastive_loss(out: Mapping[str, Tensor], loss: str, chunk_size: Optional[int] = None) -> Tensor:
    """This rank's share of the global-batch loss from a model's output.

    Args:
        out: ``image_features`` (B, D), ``text_features`` (B, D) L2-normalised, ``logit_scale``
            (exponentiated) and, for SigLIP, ``logit_bias``.
        loss: ``clip`` or ``siglip``.
        chunk_size: columns per block of the chunked loss; ``None``: the (B, N) logits whole.

    Returns:
        Scalar loss.
    """
    image, text = out["image_features"], out["text_features"]
    # Training batches are full and equal on every rank (the data module's exact epochs and
    # resampled streams both cut whole batches), so the gathers skip the size exchange.
    offset = rank() * image.shape[0]
    all_text = gather_with_grad(text, same_size=True)  # (N, D)
    if loss == "siglip":
        return siglip_loss(image, text, out["logit_scale"], out["logit_bias"], all_text, offset, chunk_size)
    all_image = gather_with_grad(image, same_size=True)  # (N, D)
    return clip_loss(image, text, out["logit_scale"], all_image, all_text, offset, chunk_size)


@register
class Contrastive(Objective):
    """Image-text contrast (CLIP, SigLIP): the model's ``loss`` decides which, and its scalars.

    Args:
        loss: ``clip`` (softmax InfoNCE) or ``siglip`` (sigmoid, with a learnable bias); set from
            the model's own ``loss`` (the temperature and bias are the model's parameters, as in
            open_clip: ``model.logit_scale``, ``model.logit_bias``).
        weight, start: see :class:`~mmssl.objectives.base.Objective`.
        chunk_size: score the N gathered columns this many at a time, rebuilding each block's
            logits in the backward: the loss's saved and working memory grow with B x
            ``chunk_size`` instead of B x N (mmssl/losses.py), for one more (B, N, D) product per
            step. ``None``: the dense loss. Composes with GradCache (``contrastive_chunk_size``),
            which chunks the towers.
    """

    name = "contrastive"
    order = 0

    def __init__(self, loss: Literal["clip", "siglip"] = "clip", weight: float = 1.0,
                 start: Union[int, float] = 0, chunk_size: Optional[int] = None) -> None:
        super().__init__(weight, start)
        if loss not in LOSS_INIT:
            raise ConfigError(f"model.loss: {loss!r} is not one of {sorted(LOSS_INIT)}")
        if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                       or chunk_size < 1):
            raise ConfigError(f"model.init_args.objectives.contrastive.chunk_size: an integer >= 1 (or null), "
                              f"got {chunk_size!r}")
        self.loss = loss
        self.chunk_size = chunk_size
        self.val_loss = MeanMetric()  # per batch, weighted by its samples

    def forward(self, out: Mapping[str, Any], batch: Mapping[str, Tensor], weight: float) -> Tensor:
        if not self.weight:
            return out["image_features"].new_zeros(())
        return weight * contrastive_loss(out, self.loss, self.chunk_size)

    def validation(self, out: Mapping[str, Tensor], batch: Mapping[str, Tensor]) -> Tensor:
        # Each batch against its own negatives (the last batch may be partial), weighted by its
        # size: equal to one process's figure when the batches are the same.
        image, text, scale = out["image_features"], out["text_features"], out["logit_scale"]
        if self.loss == "siglip":
            loss = siglip_loss(image, text, scale, out["logit_bias"], chunk_size=self.chunk_size)
        else:
            loss = clip_loss(image, text, scale, chunk_size=self.chunk_size)
        self.val_loss.update(loss.detach(), weight=image.shape[0])
        return loss

    def log_validation(self, module: Any) -> None:
        module.log("val/contrastive_loss", self.val_loss)


__all__ = ["LOSS_INIT", "Contrastive", "contrastive_loss"]
