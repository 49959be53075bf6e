"""CoCa LightningModule (Yu et al. 2022, "CoCa: Contrastive Captioners are Image-Text Foundation
Models") over open_clip's own ``CoCa`` model and ``CoCaLoss``.

open_clip builds the image tower (attentional pooling: one contrastive query and
``attn_pooler_queries`` tokens for the decoder), the unimodal text tower (a class token appended
for the contrastive embedding) and the multimodal text decoder, from any CoCa config it knows
(``coca_ViT-B-32``, ``coca_ViT-L-14``) or a JSON file with a ``multimodal_cfg``. The loss is
``open_clip.loss.CoCaLoss``: ``clip_loss_weight`` x CLIP's InfoNCE + ``caption_loss_weight`` x the
teacher-forced next-token cross-entropy (CoCa sec. 3.2, eq. 4).

Exact under DDP, like :class:`mmssl.models.clip.CLIP`:

* contrastive: ``CoCaLoss`` with ``local_loss=True``; its gather is mmssl's one gather
  (:func:`mmssl.distributed.gather_with_grad`, differentiable) instead of open_clip's
  ``torch.distributed.nn.all_gather`` (deprecated in torch 2.14, warned at every step). Each rank
  scores its B rows against all N columns; the mean over ranks is the global-batch loss.
* captioning: ``CoCaLoss``'s ``CrossEntropyLoss(ignore_index=pad_id)`` is a mean over the rank's
  *non-pad label tokens*, not over samples, and captions differ in length, so the plain mean over
  ranks would weight a rank's tokens by 1 / (its token count). Each rank's caption loss is
  rescaled by ``n_r * world / N`` (``n_r`` its tokens, ``N`` all ranks' tokens, one all-reduce of
  a count per step): the mean over ranks is then the token mean of the concatenated batch (tested
  on 2 gloo processes through the CLI).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import open_clip
import torch
import torch.distributed as dist
from open_clip.loss import ClipLoss, CoCaLoss
from torch import Tensor
from torch.utils.checkpoint import checkpoint
from torchmetrics import MeanMetric

from mmssl.distributed import gather_with_grad, is_distributed, rank, world_size
from mmssl.log_cadence import logging_step
from mmssl.losses import clip_loss
from mmssl.models import generation
from mmssl.models.clip import CLIP
from mmssl.models.distill import Distillation
from mmssl.models.open_clip_config import build_tokenizer, resolve_model_name
from mmssl.models.parts import as_group
from mmssl.upstream import attached_trainer


class GatheredCoCaLoss(CoCaLoss):
    """open_clip's ``CoCaLoss`` whose contrastive gather is :func:`mmssl.distributed.gather_with_grad`.

    Built with ``local_loss=True, gather_with_grad=True``: ``ClipLoss.forward`` takes the labels
    ``arange(B) + B * rank`` (``get_ground_truth``) and the logits from :meth:`get_logits`, the only
    method replaced. ``rank`` / ``world_size`` are set before each call (:meth:`CoCa.losses`).
    """

    def get_logits(self, image_features: Tensor, text_features: Tensor, logit_scale: Tensor,
                   logit_bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """(B, D) x 2 -> (B, N) logits per image and per text against every rank's features."""
        all_image = gather_with_grad(image_features, same_size=True)  # (N, D)
        all_text = gather_with_grad(text_features, same_size=True)  # (N, D)
        return logit_scale * image_features @ all_text.T, logit_scale * text_features @ all_image.T

    def contrastive(self, image_features: Tensor, text_features: Tensor, logit_scale: Tensor) -> Tensor:
        """The weighted contrastive term alone (``ClipLoss.forward``), as ``forward`` computes it."""
        if not self.clip_loss_weight:
            return image_features.new_zeros(())
        return self.clip_loss_weight * ClipLoss.forward(self, image_features, text_features, logit_scale)


def check_clip_args(clip_args: dict[str, Any]) -> None:
    """Refuse the CLIP options a CoCa cannot honour, naming the key (they would be ignored silently)."""
    distill = as_group(Distillation, clip_args.get("distill"), "model.init_args.distill")
    refused = {
        "loss": clip_args.get("loss", "clip") != "clip",  # CoCaLoss is softmax InfoNCE only
        "init_logit_bias": clip_args.get("init_logit_bias") is not None,  # SigLIP's
        "trim_text_padding": bool(clip_args.get("trim_text_padding")),  # the class token sits after the caption
        "distill": any(v is not None for v in (distill.teacher, distill.embeddings, distill.embed_dim)),
        "lora": clip_args.get("lora") is not None,
    }
    named = [k for k, bad in refused.items() if bad]
    if named:
        raise ValueError(f"model.init_args.{named[0]}: CoCa does not take it (of CLIP's options, CoCa trains the "
                         "softmax contrastive loss without distillation or LoRA and runs its text tower on the "
                         "whole context); leave it unset")


def check_text_tower_local(name: str) -> None:
    """Refuse a config whose text tower is a Hugging Face model not on this machine (open_clip would
    download its config); mmssl never downloads. Raises FileNotFoundError with the fetch command."""
    hf_model = open_clip.get_model_config(name).get("text_cfg", {}).get("hf_model_name")
    if hf_model is None or os.path.isdir(hf_model):
        return
    try:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(hf_model, local_files_only=True)
    except (OSError, ValueError):
        raise FileNotFoundError(
            f"model.model_name: {name!r} has the Hugging Face text tower {hf_model!r} (text_cfg.hf_model_name), "
            f"which is not on this machine and mmssl never downloads: fetch it once (huggingface-cli download "
            f"{hf_model} --local-dir DIR) and name DIR as text_cfg.hf_model_name in a JSON model config"
        ) from None


class CoCa(CLIP):
    """Contrastive captioner: CLIP's towers plus a multimodal decoder trained to caption.

    Args:
        model_name: open_clip CoCa config name (``coca_ViT-B-32``) or a JSON config with a ``multimodal_cfg``.
        caption_loss_weight: weight of the captioning loss (CoCa sec. 4.1: lambda_Cap = 2;
            ``open_clip_train --coca-caption-loss-weight`` default 2.0).
        clip_loss_weight: weight of the contrastive loss (lambda_Con = 1; ``--coca-contrastive-loss-weight`` 1.0).
        **clip_args: :class:`mmssl.models.clip.CLIP`'s arguments and parts, as CLIP takes them
            (``pretrained``: a local open_clip CoCa file; ``tokenizer``: the folder of a Hugging Face
            tokenizer a config names, built before the model so a missing one is the first error).
            The contrastive loss is always CLIP's softmax one (``CoCaLoss`` has no sigmoid variant);
            ``flip`` masks the patches both the contrastive query and the decoder's queries pool;
            ``contrastive_chunk_size`` (GradCache) embeds and decodes chunk by chunk, the caption
            loss summed per chunk (it is per-token, so chunking leaves it exact). Distillation and
            LoRA are CLIP's only: refused here.
    """

    def __init__(self, model_name: str = "coca_ViT-B-32", caption_loss_weight: float = 2.0,
                 clip_loss_weight: float = 1.0, **clip_args: Any) -> None:
        name = resolve_model_name(model_name)
        if "multimodal_cfg" not in open_clip.get_model_config(name):
            raise ValueError(f"model.model_name: {model_name!r} is no CoCa config (it has no multimodal_cfg); "
                             "train it with mmssl.models.clip.CLIP")
        if caption_loss_weight < 0 or clip_loss_weight < 0:
            raise ValueError(f"model.caption_loss_weight and clip_loss_weight must be >= 0, "
                             f"got {caption_loss_weight}, {clip_loss_weight}")
        check_clip_args(clip_args)
        built_tokenizer = build_tokenizer(name, clip_args.get("tokenizer"))  # before the model: the first error
        check_text_tower_local(name)
        super().__init__(model_name=model_name, **clip_args)
        if clip_args.get("pretrained") is None:
            # open_clip 3.3's MultimodalTransformer leaves its text_projection as torch.empty memory
            # (zeros when fresh pages back it, else garbage: caption losses of 1e12 in a test); its
            # init_parameters, which would set it, is never called and fails if called (it reads a
            # `transformer` attribute the class lacks). Its intended value: normal, std width ** -0.5.
            decoder = self.model.text_decoder
            torch.nn.init.normal_(decoder.text_projection, std=decoder.width ** -0.5)
        self.trim_text_padding = False  # the decoder reads every position, the class token sits after the caption
        self._tokenizer = built_tokenizer
        self.pad_id: int = int(self.model.pad_id)
        self.loss = GatheredCoCaLoss(caption_loss_weight=caption_loss_weight, clip_loss_weight=clip_loss_weight,
                                     pad_id=self.pad_id, local_loss=True, gather_with_grad=True)
        self.val_contrastive = MeanMetric()  # per batch, weighted by its samples (CLIP's val/loss)
        self.val_caption = MeanMetric()  # per batch, weighted by its label tokens: the token mean
        self.val_token_top1 = MeanMetric()  # next-token accuracy of the teacher-forced decoder

    def forward(self, images: Tensor, tokens: Tensor) -> dict[str, Tensor]:
        """open_clip ``CoCa.forward``: ``image_features`` / ``text_features`` (B, D) normalised,
        ``logits`` (B, L-1, V) of the decoder predicting ``labels`` (B, L-1) = ``tokens[:, 1:]``,
        ``logit_scale`` () exponentiated."""
        return self.model(images, tokens)

    # Loss ----------------------------------------------------------------------------------------

    def _caption_sum(self, logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        """(B, L-1, V), (B, L-1) -> (sum of the token cross-entropies, number of non-pad tokens)."""
        count = (labels != self.pad_id).sum()
        mean = self.loss.caption_loss(logits.permute(0, 2, 1), labels)  # (B, V, L-1): CE over dim 1
        return mean * count, count

    def _chunk(self, images: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """One GradCache chunk: (b, D) image and text features and the chunk's caption CE sum."""
        out = self.model(images, tokens)
        return out["image_features"], out["text_features"], self._caption_sum(out["logits"], out["labels"])[0]

    # Under FSDP2 the root's parameters are gathered for these as for ``forward`` (mmssl.sharding).
    fsdp_forward_methods = ("losses",)

    def losses(self, images: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """This rank's weighted (contrastive, caption) losses; their mean over ranks is the loss
        of one process on the concatenated batch (see the module docstring).

        Args:
            images: (B, 3, H, W), the same B on every rank (training batches are full).
            tokens: (B, L) token ids.

        Returns:
            Two scalars, already multiplied by ``clip_loss_weight`` / ``caption_loss_weight``.
        """
        self.loss.rank, self.loss.world_size = rank(), world_size()
        labels = tokens[:, 1:]  # (B, L-1): what open_clip's CoCa predicts
        count = (labels != self.pad_id).sum()
        chunk = self.contrastive_chunk_size
        if self.training and chunk is not None and images.shape[0] > chunk:
            parts = [checkpoint(self._chunk, i, t, use_reentrant=False, preserve_rng_state=True)
                     for i, t in zip(images.split(chunk), tokens.split(chunk))]  # K x ((b, D), (b, D), ())
            image, text = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            contrastive = self.loss.contrastive(image, text, self.model.logit_scale.exp())
            caption = self.loss.caption_loss_weight * torch.stack([p[2] for p in parts]).sum() / count
        else:
            out = self.model(images, tokens)
            contrastive, caption = self.loss(out["image_features"], out["text_features"], out["logits"],
                                             out["labels"], out["logit_scale"])
        if is_distributed():
            total = count.detach().clone()
            dist.all_reduce(total)  # every rank's label tokens: N
            caption = caption * (count * world_size() / total)
        return contrastive, caption

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        contrastive, caption = self.losses(batch["image"], batch["text"])
        loss = contrastive + caption
        self.log("train/loss", loss, prog_bar=True)
        if logging_step(attached_trainer(self)):
            self.log("train/contrastive_loss", contrastive.detach())
            self.log("train/caption_loss", caption.detach())
            self.log("train/logit_scale", self.model.logit_scale.exp().detach())
            self.log("train/image_mask_ratio", float(self.flip.ratio))
        return loss

    # Validation: CLIP's retrieval, plus the captioning figures ----------------------------------

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        out = self(batch["image"], batch["text"])  # eval mode: unmasked
        image, text, scale = out["image_features"], out["text_features"], out["logit_scale"]
        contrastive = clip_loss(image, text, scale)  # each batch against its own negatives, as CLIP's
        caption_sum, count = self._caption_sum(out["logits"], out["labels"])
        caption = caption_sum / count.clamp(min=1)
        loss = self.loss.clip_loss_weight * contrastive + self.loss.caption_loss_weight * caption
        self.validation.update(image, text, loss)
        self.val_contrastive.update(contrastive.detach(), weight=image.shape[0])
        self.val_caption.update(caption.detach(), weight=count)
        mask = out["labels"] != self.pad_id
        hits = (out["logits"].argmax(dim=-1) == out["labels"])[mask].float().sum()
        self.val_token_top1.update(hits / count.clamp(min=1), weight=count)

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()  # val/loss, val/i2t_R@k, val/t2i_R@k
        self.log("val/contrastive_loss", self.val_contrastive)
        self.log("val/caption_loss", self.val_caption)  # unweighted token mean (caption_loss_weight not applied)
        self.log("val/caption_token_top1", self.val_token_top1)

    def generation_ids(self) -> dict[str, int]:
        """Start, end and pad token ids of this model's tokenizer (open_clip's BPE, or a Hugging Face one)."""
        tok = getattr(self.tokenizer, "tokenizer", None)  # an open_clip HFTokenizer wraps a transformers one
        if tok is not None and getattr(tok, "eos_token_id", None) is not None:
            sot = tok.bos_token_id if tok.bos_token_id is not None else tok.cls_token_id
            return {"sot_token_id": int(sot), "eos_token_id": int(tok.eos_token_id), "pad_token_id": self.pad_id}
        return {"sot_token_id": int(self.tokenizer.sot_token_id), "eos_token_id": int(self.tokenizer.eot_token_id),
                "pad_token_id": self.pad_id}

    def generate(self, images: Tensor, generation_type: str = "beam_search", seq_len: Optional[int] = None,
                 **params: Any) -> Tensor:
        """Captions as token ids, (B, 3, H, W) -> (B, T), ``T <= seq_len`` (start token first):
        :func:`mmssl.models.generation.generate` with this tokenizer's special ids.

        Args:
            images: preprocessed images.
            generation_type: ``beam_search``, ``top_p`` or ``top_k``.
            seq_len: longest output, at most the text context (``model.context_length``); ``None``:
                the text context (a fixed default refused models with a shorter one: the demo CoCa's 18).
            **params: the generation type's parameters (``num_beams``, ``top_p``, ``top_k``, ...).
        """
        seq_len = self.model.context_length if seq_len is None else seq_len
        if not 2 <= seq_len <= self.model.context_length:
            raise ValueError(f"seq_len must be in [2, {self.model.context_length}] (the text context), got {seq_len}")
        if generation_type != "beam_search":
            params.setdefault("max_seq_len", self.model.context_length)
        return generation.generate(self.model, images, generation_type, seq_len=seq_len,
                                   **self.generation_ids(), **params)
