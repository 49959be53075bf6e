"""Masked language modelling (BERT, Devlin et al. 2018, sec. 3.1; FLAVA's unimodal MLM on the text
encoder; ALBEF ``configs/Pretrain.yaml`` ``mlm_probability: 0.15``): predict the chosen words of each
caption from both sides.

Before the forward (:meth:`MaskedLanguageModelling.prepare`) ``mask_ratio`` of each caption's
maskable tokens are chosen and corrupted 80/10/10 (``mask_share`` / ``random_share``) by the host in
its own vocabulary (``host.mask_captions``: its mask token, its special ids; start/end-of-text and
padding never chosen), from 3 uniforms per token. The host's forward runs the corrupted captions
(``masked_tokens``) through the text tower, in the same call as the clean ones, and returns their
token states (``masked_states`` (B, L, W), after ``ln_final``); the host's ``mlm_head`` (BERT's
``BertLMPredictionHead``, tied to the token embedding) scores the chosen ones. The contrastive and
matching terms read the clean captions (ALBEF ``model_pretrain.py`` encodes the unmasked text for
both and masks a copy for MLM).

The term is a token mean over the global batch, exact under DDP: each rank's summed cross-entropy
is divided by every rank's chosen-token count (one all-reduce of a count, as the caption term) and
multiplied by the world size, so the mean over ranks is one process's token mean. A caption without
a maskable token adds nothing. Validation is collective-free: each batch's token mean, kept as a
mean over the set weighted by its tokens.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Union

import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torchmetrics import MeanMetric

from mmssl.distributed import is_distributed, world_size
from mmssl.errors import ConfigError
from mmssl.objectives.base import Objective, register


@register
class MaskedLanguageModelling(Objective):
    """BERT's masked words, predicted by the host's ``mlm_head`` from a bidirectional text tower.

    Args:
        weight: the term's weight (ALBEF, FLAVA: 1).
        start: see :class:`~mmssl.objectives.base.Objective`.
        mask_ratio: share of each caption's maskable tokens chosen, in (0, 1) (BERT: 0.15).
        mask_share: share of the chosen tokens replaced by the mask token (BERT: 0.8).
        random_share: share replaced by a random token (BERT: 0.1); the rest stay.
    """

    name = "mlm"
    order = 20  # after the contrastive term; its draws before matching's negatives
    host_parts = ("mlm_head", "mask_captions")
    inputs = ("masked_tokens",)
    chunked = False  # reads every caption's token states at once

    def __init__(self, weight: float = 1.0, start: Union[int, float] = 0, mask_ratio: float = 0.15,
                 mask_share: float = 0.8, random_share: float = 0.1) -> None:
        super().__init__(weight, start)
        key = f"model.init_args.objectives.{self.name}"
        if not 0.0 < mask_ratio < 1.0:
            raise ConfigError(f"{key}.mask_ratio must be in (0, 1), got {mask_ratio}")
        if not 0.0 <= mask_share <= 1.0:
            raise ConfigError(f"{key}.mask_share must be in [0, 1], got {mask_share}")
        if not 0.0 <= random_share <= 1.0 - mask_share:
            raise ConfigError(f"{key}.random_share must be in [0, 1 - mask_share], got {random_share}")
        self.mask_ratio, self.mask_share, self.random_share = mask_ratio, mask_share, random_share
        self.figures: dict[str, Tensor] = {}  # of the last training step: train/mlm_top1, ...
        self.val_loss = MeanMetric()  # per batch, weighted by its chosen tokens: the token mean
        self.val_top1 = MeanMetric()

    def check(self, host: nn.Module, model_name: str) -> None:
        model = host.model
        if getattr(model, "transformer", None) is None or getattr(model, "attn_mask", None) is not None:
            raise ConfigError(f"model.init_args.objectives.mlm: the text tower of {model_name!r} is causal (each "
                              "token sees only those before it), so MLM cannot predict from both sides: set "
                              "text_cfg.no_causal_mask: true in its JSON config (an open_clip text transformer)")

    def draws(self, batch: Mapping[str, Tensor], training: bool) -> int:
        return 3 * batch["text"].shape[1]  # per token: choice order, 80/10/10, random id

    def prepare(self, host: nn.Module, batch: Mapping[str, Tensor], uniforms: Optional[Tensor],
                training: bool) -> dict[str, Tensor]:
        tokens = batch["text"]  # (B, L)
        noise = uniforms.reshape(*tokens.shape, 3)  # (B, L, 3)
        masking = host.mask_captions(tokens, noise, self.mask_ratio, self.mask_share, self.random_share)
        return {"masked_tokens": masking.input_ids, "mlm_labels": masking.labels, "mlm_selected": masking.selected}

    def sums(self, states: Tensor, batch: Mapping[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """(CE sum, top-1 hits, count) over the chosen tokens of the corrupted captions.

        Args:
            states: (B, L, W) the text tower's states of ``batch["masked_tokens"]``.
            batch: with ``mlm_labels`` (B, L) and ``mlm_selected`` (B, L) from :meth:`prepare`.
        """
        selected = batch["mlm_selected"]
        head, embedding = self.host.mlm_head, self.host.model.token_embedding.weight
        logits = head(states[selected], embedding)  # (M, V)
        labels = batch["mlm_labels"][selected]  # (M,) every one a target
        ce_sum = F.cross_entropy(logits.float(), labels, reduction="sum")
        return ce_sum, (logits.argmax(dim=-1) == labels).sum(), selected.sum()

    def forward(self, out: Mapping[str, Any], batch: Mapping[str, Tensor], weight: float) -> Tensor:
        ce_sum, correct, count = self.sums(out["masked_states"], batch)
        total = count.detach().clone()
        if is_distributed():
            dist.all_reduce(total)  # every rank's chosen tokens
        mlm = ce_sum * world_size() / total.clamp_min(1)  # mean over ranks: the global token mean
        self.figures = {"mlm_top1": correct.float() / count.clamp_min(1),
                        "captions_without_target": (~batch["mlm_selected"].any(dim=1)).sum().float()}
        return weight * mlm

    def validation(self, out: Mapping[str, Tensor], batch: Mapping[str, Tensor]) -> Tensor:
        ce_sum, correct, count = self.sums(out["masked_states"], batch)
        mlm = ce_sum / count.clamp_min(1)
        self.val_loss.update(mlm.detach(), weight=count)  # token mean over the set
        self.val_top1.update(correct.float() / count.clamp_min(1), weight=count)
        return mlm

    def log_training(self, module: Any) -> None:
        module.log("train/mlm_top1", self.figures["mlm_top1"])  # this rank's chosen tokens
        module.log("train/captions_without_target", self.figures["captions_without_target"], reduce_fx="sum")

    def log_validation(self, module: Any) -> None:
        module.log("val/mlm_loss", self.val_loss)  # the unweighted token mean
        module.log("val/mlm_top1", self.val_top1)
