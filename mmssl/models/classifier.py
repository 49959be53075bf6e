"""End-to-end fine-tuning of a pretrained ViT for classification: the ``ImageClassifier`` module.

Follows facebookresearch/mae ``main_finetune.py`` (FINETUNE.md): a timm ``VisionTransformer`` with
a new head, global average pooling of the patch tokens + ``fc_norm`` (``models_vit.py``, the
default) or the cls token, ``drop_path_rate``, AdamW over layer-wise LR-decay groups
(``util/lr_decay.py``, here timm's ``param_groups_layer_decay``, which assigns the same layer ids),
lr = blr x global batch / 256, per-step warm-up + cosine to ``min_lr`` (``util/lr_sched.py``),
timm's ``Mixup`` / CutMix with label smoothing and ``SoftTargetCrossEntropy``. The augmentations
(RandAugment, random erasing) are data transforms (``ImageTextDataModule(train_augment=...)``).

The encoder is initialised from an mmssl MAE checkpoint, an mmssl CLIP checkpoint whose image
tower is a timm model, an exported timm state dict, an MAE release, or nothing (from scratch).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Union

import numpy as np
import timm
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info
from timm.data import Mixup
from timm.layers import trunc_normal_
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import param_groups_layer_decay
from torch import Tensor, nn
from torch.nn import functional as F
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from mmssl.data.transforms import IMAGENET_MEAN, IMAGENET_STD  # MAE util/datasets.py normalisation
from mmssl.distributed import seed_per_rank
from mmssl.log_cadence import logging_step
from mmssl.models.lora import CLASSIFIER_TRAINABLE, TIMM_TOWERS, LoraCheckpoint, enable_lora
from mmssl.models.memory import compile_blocks, compile_options
from mmssl.models.vit import load_encoder
from mmssl.models.zero_shot_head import init_zero_shot_head
from mmssl.optim import check_warmup, lr_from_blr, warmup_cosine
from mmssl.sharding import shard_model
from mmssl.upstream import attached_trainer

# Keys a pretrained encoder does not provide: the new head, and fc_norm under global pooling
# (MAE main_finetune.py asserts exactly these are missing after loading).
NEW_KEYS = frozenset({"head.weight", "head.bias", "fc_norm.weight", "fc_norm.bias"})


def finetune_adamw(params: Any) -> torch.optim.Optimizer:
    """MAE ``main_finetune.py`` optimizer: ``torch.optim.AdamW`` with its default betas.

    The LR is a placeholder (``ImageClassifier(blr=...)`` sets it); each group carries its own
    weight decay (0.05, or 0 for 1-D parameters, ``pos_embed`` and ``cls_token``).
    """
    return torch.optim.AdamW(params, lr=1e-3)


def vit_probe_tokens(model: nn.Module, images: Tensor) -> Tensor:
    """A timm ViT's ``forward_features`` in the probe layout: (B, 3, H, W) -> (B, 1+L, D), the cls
    token then the patch tokens (register tokens dropped)."""
    if getattr(model, "cls_token", None) is None:
        raise TypeError(f"{type(model).__name__} has no cls token: the probe features need one (class_token=True)")
    tokens = model.forward_features(images)  # (B, prefix+L, D)
    return torch.cat([tokens[:, :1], tokens[:, model.num_prefix_tokens:]], dim=1)


def vit_block_features(model: nn.Module, images: Tensor, pool: str = "cls", norm: bool = False) -> list[Tensor]:
    """Pooled (B, D) output of every block of a timm ViT, block 1 first (timm's
    ``forward_intermediates``): the cls token (``pool="cls"``) or the mean of the patch tokens."""
    out = model.forward_intermediates(
        images, norm=norm, output_fmt="NLC", intermediates_only=True, return_prefix_tokens=True
    )  # [((B, L, D) patches, (B, prefix, D) prefix)] per block
    return [prefix[:, 0] if pool == "cls" else patches.mean(dim=1) for patches, prefix in out]


class ImageClassifier(LoraCheckpoint, LightningModule):
    """Fine-tune a timm ViT with a new head (MAE's end-to-end fine-tuning protocol).

    Args:
        num_classes: classes of the new head.
        model_name: timm model name; ``model_kwargs`` override its shape (any timm ViT).
        model_kwargs: extra ``timm.create_model`` arguments, e.g. ``patch_size``, ``embed_dim``,
            ``depth``, ``num_heads``, ``mlp_ratio`` of the pretrained ViT.
        image_size: input side in pixels (``img_size`` of the timm model; linked to the data).
        global_pool: ``"avg"``: mean of the patch tokens then ``fc_norm`` (MAE's default,
            ``--global_pool``); ``"token"``: the final-norm cls token (``--cls_token``).
        drop_path_rate: stochastic depth (MAE: 0.1 ViT-B, 0.2 ViT-L, 0.3 ViT-H).
        init_encoder: checkpoint to initialise the ViT from (see :func:`mmssl.models.vit.load_encoder`);
            ``None`` trains from scratch. ``load_from_checkpoint(..., init_encoder=None)`` skips it.
        head_init_std: std of the new head's truncated-normal weights when ``init_encoder`` is set
            (MAE ``main_finetune.py``: 2e-5); from scratch the head keeps timm's initialisation.
        optimizer: optimizer factory over the layer-decay groups.
        blr: base LR; each group's peak LR is blr x global batch / 256 x its layer scale. ``None``
            keeps the optimizer's own ``lr`` as the peak.
        layer_decay: layer-wise LR decay (MAE: 0.65 ViT-B, 0.75 ViT-L/H; 1.0 turns it off).
        weight_decay: AdamW weight decay of the decayed groups (MAE: 0.05).
        warmup_epochs: linear warm-up in epochs, per step (MAE: 5).
        warmup_steps: the warm-up in optimizer steps instead (runs budgeted in steps).
        min_lr: LR floor of the cosine, before layer scaling (MAE: 1e-6).
        mixup: Mixup alpha (MAE: 0.8; 0 with ``cutmix`` 0 turns both off).
        cutmix: CutMix alpha (MAE: 1.0).
        mixup_prob: probability of mixing a batch (MAE: 1.0).
        mixup_switch_prob: probability of CutMix over Mixup when both are on (MAE: 0.5).
        mixup_mode: ``"batch"``, ``"pair"`` or ``"elem"`` (MAE: batch).
        label_smoothing: label smoothing (MAE: 0.1), in the mixed targets or the loss.
        image_mean: per-channel normalisation mean (linked to the data module).
        image_std: per-channel normalisation std, likewise.
        grad_checkpointing: timm's activation checkpointing of the blocks (``set_grad_checkpointing``).
        compile: ``torch.compile`` the blocks in place; ``true`` or a dict of its arguments.
        zero_shot_head: a CLIP checkpoint (timm image tower) whose text embeddings of the class
            prompts initialise the head, the CLIP's projection folded in, so that the classifier
            starts with the CLIP's zero-shot predictions (WiSE-FT; :mod:`mmssl.models.zero_shot_head`).
            Usually the ``init_encoder`` file; needs ``global_pool`` = the tower's ``timm_pool``.
        head_classnames: class-names file (or labelled set) of ``zero_shot_head``, in label order.
        head_templates: prompt templates file of ``zero_shot_head`` (default: beside the class
            names, else CLIP's 80 ImageNet prompts).
        lora: LoRA adapters ``{r, alpha, dropout, target_modules, trainable}`` on the ViT's blocks
            (``mmssl.models.lora``; the head and ``fc_norm`` train too); needs ``init_encoder``.
    """

    tokenizer = None  # images and labels only; the CLI links this into the data module

    def __init__(
        self,
        num_classes: int = 1000,
        model_name: str = "vit_base_patch16_224",
        model_kwargs: Optional[dict[str, Any]] = None,
        image_size: int = 224,
        global_pool: str = "avg",
        drop_path_rate: float = 0.1,
        init_encoder: Optional[str] = None,
        head_init_std: float = 2e-5,
        optimizer: OptimizerCallable = finetune_adamw,
        blr: Optional[float] = 5e-4,
        layer_decay: float = 0.65,
        weight_decay: float = 0.05,
        warmup_epochs: float = 5.0,
        warmup_steps: Optional[int] = None,
        min_lr: float = 1e-6,
        mixup: float = 0.8,
        cutmix: float = 1.0,
        mixup_prob: float = 1.0,
        mixup_switch_prob: float = 0.5,
        mixup_mode: str = "batch",
        label_smoothing: float = 0.1,
        image_mean: tuple[float, float, float] = IMAGENET_MEAN,
        image_std: tuple[float, float, float] = IMAGENET_STD,
        grad_checkpointing: bool = False,
        compile: Union[bool, dict[str, Any]] = False,
        zero_shot_head: Optional[str] = None,
        head_classnames: Optional[str] = None,
        head_templates: Optional[str] = None,
        lora: Optional[dict[str, Any]] = None,
    ) -> None:
        super().__init__()
        if num_classes < 2:
            raise ValueError(f"model.num_classes must be >= 2, got {num_classes}")
        if global_pool not in ("avg", "token"):
            raise ValueError(f"model.global_pool must be 'avg' (MAE's default) or 'token', got {global_pool!r}")
        if not 0.0 < layer_decay <= 1.0:
            raise ValueError(f"model.layer_decay must be in (0, 1], got {layer_decay}")
        check_warmup("model.warmup_epochs", warmup_epochs)
        check_warmup("model.warmup_steps", warmup_steps)
        self.save_hyperparameters(ignore=["optimizer"])
        self.num_classes, self.image_size = num_classes, image_size
        self.image_mean, self.image_std = tuple(image_mean), tuple(image_std)
        self.optimizer = optimizer
        self.blr, self.layer_decay, self.weight_decay = blr, layer_decay, weight_decay
        self.warmup_epochs, self.warmup_steps, self.min_lr = warmup_epochs, warmup_steps, min_lr
        self.model = timm.create_model(
            model_name, pretrained=False, num_classes=num_classes, global_pool=global_pool,
            drop_path_rate=drop_path_rate, img_size=image_size, **(model_kwargs or {}),
        )
        if not hasattr(self.model, "blocks"):
            raise ValueError(f"model.model_name={model_name!r}: layer-wise LR decay needs a ViT with `blocks`")
        self.model.set_grad_checkpointing(grad_checkpointing)  # timm's, over its blocks
        options = compile_options(compile)
        if options is not None:
            compile_blocks(self.model, options, f"model.model_name={model_name!r}")
        if init_encoder:
            missing, ignored = load_encoder(self.model, init_encoder, NEW_KEYS)
            if "head.weight" in missing:  # MAE main_finetune.py: manually initialize fc layer
                trunc_normal_(self.model.head.weight, std=head_init_std)
            rank_zero_info(f"ImageClassifier: encoder from {init_encoder}; new {missing}; "
                           f"not loaded: {len(ignored)} keys {ignored[:6]}")
        if zero_shot_head:
            init_zero_shot_head(self.model.head, zero_shot_head, head_classnames, head_templates, global_pool)
        enable_lora(self, lora, TIMM_TOWERS, {"init_encoder": init_encoder}, "init_encoder", CLASSIFIER_TRAINABLE)
        self.mixup_fn: Optional[Mixup] = None
        if mixup > 0 or cutmix > 0:
            self.mixup_fn = Mixup(
                mixup_alpha=mixup, cutmix_alpha=cutmix, prob=mixup_prob, switch_prob=mixup_switch_prob,
                mode=mixup_mode, label_smoothing=label_smoothing, num_classes=num_classes)
            self.train_loss_fn: nn.Module = SoftTargetCrossEntropy()  # smoothing is in the mixed targets
        elif label_smoothing > 0:
            self.train_loss_fn = LabelSmoothingCrossEntropy(smoothing=label_smoothing)
        else:
            self.train_loss_fn = nn.CrossEntropyLoss()
        # Correct and seen counts summed over ranks inside compute (a rank without batches joins).
        self.val_top1 = MulticlassAccuracy(num_classes, top_k=1, average="micro")
        self.val_top5 = MulticlassAccuracy(num_classes, top_k=min(5, num_classes), average="micro")
        self.val_loss = MeanMetric()

    # ---- named stages (timm forward_features / forward_head) ---------------------------------

    # The probe protocol (mmssl.evaluation.features), so that the probe and attention tools take
    # a fine-tuned checkpoint. Under global_pool="avg" timm's final ``norm`` is an Identity (the
    # norm is ``fc_norm``, after pooling): the "cls" / "avg" token features are un-normed, and
    # ``encode_image`` (the "embedding" feature) is what the head reads.

    def forward_features(self, images: Tensor) -> Tensor:
        """(B, 3, H, W) -> (B, 1+L, D): cls token then patch tokens (see :func:`vit_probe_tokens`)."""
        return vit_probe_tokens(self.model, images)

    def forward_intermediates(self, images: Tensor, pool: str = "cls", norm: bool = False) -> list[Tensor]:
        """Pooled (B, D) output of every block, block 1 first (see :func:`vit_block_features`)."""
        return vit_block_features(self.model, images, pool, norm)

    def encode_image(self, images: Tensor) -> Tensor:
        """(B, 3, H, W) -> (B, D) pooled features before the head (what probes read)."""
        return self.model.forward_head(self.model.forward_features(images), pre_logits=True)

    def forward(self, images: Tensor) -> Tensor:
        """(B, 3, H, W) -> (B, num_classes) logits."""
        return self.model(images)

    # ---- training ------------------------------------------------------------------------------

    def configure_model(self) -> None:
        # FSDP2 (ModelParallelStrategy): each transformer block a unit, then the root (mmssl.sharding).
        shard_model(self, attached_trainer(self))

    def on_fit_start(self) -> None:
        # Each rank draws its own drop-path masks and mixes (MAE seeds args.seed + rank); timm's
        # Mixup draws from numpy's global RNG, so that is seeded per rank too.
        seed_per_rank(self.global_rank, self.trainer.world_size)
        np.random.seed(torch.initial_seed() % 2**32)

    def _labels(self, batch: dict[str, Tensor]) -> Tensor:
        if "label" not in batch:
            raise KeyError("ImageClassifier needs labelled samples: the batch has no 'label'; the shards need a "
                           "class entry (data.label_key, default 'cls') in every sample")
        labels = batch["label"]
        if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= self.num_classes):
            raise ValueError(f"labels must be in [0, model.num_classes={self.num_classes}), "
                             f"got {int(labels.min())}..{int(labels.max())}")
        return labels

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        images, labels = batch["image"], self._labels(batch)
        if self.mixup_fn is not None:
            if images.shape[0] % 2:
                raise ValueError(f"timm's Mixup needs an even batch, got {images.shape[0]}: set data.batch_size even")
            images, targets = self.mixup_fn(images, labels)  # (B, 3, H, W), (B, num_classes) soft
            loss = self.train_loss_fn(self(images), targets)
        else:
            loss = self.train_loss_fn(self(images), labels)
        self.log("train/loss", loss, prog_bar=True, batch_size=images.shape[0])
        trainer = attached_trainer(self)
        if trainer is not None and trainer.optimizers and logging_step(trainer):
            # The head's group is at layer scale 1: this is the schedule's LR.
            self.log("train/lr", max(g["lr"] for g in trainer.optimizers[0].param_groups))
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        images, labels = batch["image"], self._labels(batch)
        logits = self(images)  # (B, num_classes)
        self.val_top1.update(logits, labels)
        self.val_top5.update(logits, labels)
        # MAE engine_finetune.evaluate: plain cross-entropy, no smoothing.
        self.val_loss.update(F.cross_entropy(logits, labels), weight=images.shape[0])

    def on_validation_epoch_end(self) -> None:
        # Logged as metric objects: Lightning computes (a reduction over ranks, joined by every
        # rank, including one whose share of the validation shards was empty) and resets them.
        self.log("val/top1", self.val_top1, prog_bar=True)
        self.log("val/top5", self.val_top5)
        self.log("val/loss", self.val_loss)

    # ---- optimisation --------------------------------------------------------------------------

    def configure_optimizers(self) -> dict:
        # MAE util/lr_decay.py param_groups_lrd: timm's version gives the same layer ids
        # (cls_token, pos_embed, patch_embed: 0; blocks.i: i+1; the rest: depth+1) and scales
        # layer_decay ** (depth + 1 - id), no weight decay for 1-D params and no_weight_decay().
        groups = param_groups_layer_decay(
            self.model, weight_decay=self.weight_decay, no_weight_decay_list=self.model.no_weight_decay(),
            layer_decay=self.layer_decay)
        optimizer = self.optimizer(groups)
        total_steps = self.trainer.estimated_stepping_batches  # loads the training loader
        lr = optimizer.param_groups[0]["lr"]
        if self.blr is not None:
            lr = lr_from_blr(self.blr, self.trainer, "ImageClassifier")
        for group in optimizer.param_groups:  # MAE util/lr_sched.py: lr x lr_scale per group
            group["lr"] = group["initial_lr"] = lr * group["lr_scale"]
        batches = self.trainer.num_training_batches
        if not math.isfinite(batches):  # a loader without a length: epochs from the step budget
            batches = total_steps * self.trainer.accumulate_grad_batches / max(1, self.trainer.max_epochs or 1)
        steps_per_epoch = max(1, int(batches) // self.trainer.accumulate_grad_batches)
        warmup = self.warmup_steps if self.warmup_steps is not None else round(self.warmup_epochs * steps_per_epoch)
        min_ratio = min(1.0, self.min_lr / lr) if lr > 0 else 0.0
        scheduler = warmup_cosine(optimizer, warmup, total_steps, min_ratio)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
