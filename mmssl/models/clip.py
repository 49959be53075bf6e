"""CLIP LightningModule over open_clip towers (Radford et al. 2021), with SigLIP and FLIP.

open_clip builds the towers, the tokenizer and the preprocessing config, so any model config name
it knows (``open_clip.list_models()``) or a JSON config file of ours works unchanged, timm image
towers included. On N ranks the loss is exact: features are gathered from every rank with
gradients (``mmssl.distributed.gather_with_grad``) and each rank scores its own rows against all
columns, open_clip's ``local_loss`` + ``gather_with_grad`` setting.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable, Literal, Mapping, Optional, Union

import lightning.pytorch as pl
import open_clip
import torch
from lightning.pytorch.cli import OptimizerCallable
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from mmssl.checkpoints.read import checkpoint_exists
from mmssl.data.decode import trim_text_padding
from mmssl.distributed import is_sharded, rank, seed_per_rank
from mmssl.errors import ConfigError
from mmssl.log_cadence import logging_step
from mmssl.models import tower_passes
from mmssl.models.distill import DISTILL_RENAMES, Distillation, build_distiller
from mmssl.models.flip import FLIP_RENAMES, Flip, install_flip_masking
from mmssl.models.gradcache import cached_features
from mmssl.models.lit import init_image_tower
from mmssl.models.locking import LOCK_RENAMES, LockOptions, lock_towers
from mmssl.models.lora import CLIP_TRAINABLE, LoraCheckpoint, clip_towers, enable_lora
from mmssl.models.masking import random_masking, sample_noise
from mmssl.models.memory import apply_memory_options
from mmssl.models.open_clip_config import (  # noqa: F401  (re-exported: mmssl.models.clip's public names)
    OPEN_CLIP_NO_DECAY,
    build_tokenizer,
    checkpoint_has,
    create_model,
    resolve_model_name,
    text_padding_is_inert,
)
from mmssl.models.parts import RetrievalValidation, as_group, plain_groups
from mmssl.models.scalars import install_scalar_hooks, record_scalar_keys, scalars_as_vectors
from mmssl.models.teacher import tokenizer_signature
from mmssl.objectives import (
    LOSS_INIT,
    Objective,
    build_objectives,
    check_parts,
    contrastive_loss,
    has_parts,
    sample_uniforms,
)
from mmssl.optim import (
    build_optimizer,
    check_layer_decay,
    check_warmup,
    layer_scales,
    record_shapes,
    unmatched_patterns,
    warmup_cosine,
)
from mmssl.sharding import shard_model
from mmssl.upstream import attached_trainer, open_clip_encode_text_prefix

__all__ = ["CLIP", "LOSS_INIT", "CLIP_TOWERS"]

# open_clip's towers as this module names their parameters (``CLIP`` keeps the text tower at its top
# level, ``CustomTextCLIP`` under ``text``): the units of per-tower layer decay.
CLIP_TOWERS = {
    "image": ("model.visual.*",),
    "text": ("model.text.*", "model.transformer.*", "model.token_embedding.*", "model.positional_embedding",
             "model.ln_final.*", "model.text_projection*"),
}


class CLIP(LoraCheckpoint, pl.LightningModule):
    """Image-text pretraining over open_clip towers: CLIP, SigLIP, FLIP, LiT and CoCa from one module.

    What it trains is its ``objectives`` (:mod:`mmssl.objectives`), composed by name: the
    contrastive loss (``loss``: CLIP's or SigLIP's) and, for a model with a caption decoder (an
    open_clip CoCa config), captioning; each with a weight and a start. SigLIP with a captioning
    decoder is ``loss: siglip`` with ``objectives: {caption: {}}`` on a CoCa config, as
    :class:`~mmssl.models.coca.CoCa` is this module with captioning on by default.

    The features it shares with other models are parts, each a config group taken whole:
    ``flip`` (FLIP's masking and unmasked tuning, :class:`~mmssl.models.flip.Flip`), ``lock``
    (LiT's tower locking, :class:`~mmssl.models.locking.LockOptions`), ``distill`` (a frozen
    teacher, :class:`~mmssl.models.distill.Distillation`), ``lora`` (:mod:`mmssl.models.lora`),
    GradCache (``contrastive_chunk_size``, :mod:`mmssl.models.gradcache`) and the held-out retrieval
    figures (:class:`~mmssl.models.parts.RetrievalValidation`).

    Args:
        model_name: open_clip model config name, or path to a JSON config file.
        pretrained: local open_clip checkpoint file to start from (e.g. one written by
            ``tools/export.py --format open_clip``) or an mmssl CLIP Lightning checkpoint of the
            same model config; ``None`` for random init. Never downloads.
        loss: ``clip`` (softmax InfoNCE) or ``siglip`` (sigmoid loss with a learnable bias).
        init_logit_scale: initial log of the logit scale; ``None``: log(1/0.07) for clip,
            log(10) for siglip.
        init_logit_bias: initial logit bias; ``None``: none for clip, -10 for siglip.
        logit_scale_max: clamp of the learned logit scale (CLIP: 100).
        optimizer: optimizer factory over two parameter groups (decayed, and weight decay 0 for
            the ``no_weight_decay`` parameters; per layer with ``layer_decay``); AdamW by default.
            A Muon-family optimizer (``timm.optim.Muon``, its ``algo: adamuon`` and ``nesterov``
            variants) takes the blocks' weight matrices; every other parameter goes to its AdamW
            fallback at ``lr x fallback_lr_scale`` (:func:`mmssl.optim.muon_takes`, docs/scale.md).
        layer_decay: layer-wise LR decay in pretraining (open_clip main, BEiT): a float for both
            towers or ``{image: 0.75, text: 0.8}``; each tower's block N of depth D trains at
            ``decay ** (D - N)`` x the LR, its embeddings at ``decay ** (D + 1)``, its final norm and
            projection, the logit scale and a caption decoder at 1. ``None``: off.
        warmup_steps: linear warm-up steps before the cosine decay.
        min_lr_ratio: final LR of the cosine as a fraction of the peak.
        no_weight_decay: which parameters are not decayed: ``fnmatch`` globs on the names of
            ``named_parameters()`` (``model.visual.positional_embedding``), plus ``"ndim<2"`` for
            every parameter built with fewer than 2 dims. Decided from names and shapes recorded
            at build time, so it holds under FSDP's flattened parameters. ``None``: open_clip's
            rule (``open_clip_train/main.py``: ndim < 2, or "bn", "ln", "bias", "logit_scale" in
            the name); recipes set the rule of their own source.
        tokenizer: local folder of a Hugging Face tokenizer, for model configs whose tokenizer
            is one (``ViT-B-16-SigLIP``: SentencePiece); mmssl never downloads it.
        trim_text_padding: run the text tower only up to the longest caption of each batch
            instead of the full context (open_clip always runs all ``context_length`` positions).
            Exact: with a causal text tower and end-of-text pooling the output is unchanged
            (tested); ``None`` switches it on exactly when that holds, ``True`` insists (and fails
            for a tower where it would change the output), ``False`` keeps the full context.
        contrastive_chunk_size: GradCache (Gao et al. 2021): in training, run the towers this
            many samples at a time and rebuild each chunk's activations in the backward, so
            memory grows with the chunk, not the per-device batch, while the loss and every
            gradient stay those of the whole batch (``mmssl.models.gradcache``); costs one
            more forward of the towers per step. ``None``: the whole batch at once.
        grad_checkpointing: activation checkpointing of both towers (open_clip's
            ``set_grad_checkpointing``): less activation memory for one more forward of each
            block per step; the same gradients (``mmssl.models.memory``).
        compile: ``torch.compile`` the towers' transformer blocks in place (regional
            compilation); ``true`` for torch's defaults or a dict of ``torch.compile`` arguments
            (``{mode: max-autotune}``). Pays on GPUs; docs/benchmarks.md has the figures.
        image_tower_init: LiT from an MAE: a ViT checkpoint (mmssl MAE, a timm export of one, ...)
            that fills a timm image tower (``mmssl.models.lit``); pair with ``lock.image``.
        image_mean: per-channel normalisation mean (linked to the data module); ``None``: open_clip's
            (OpenAI's). A tower pretrained elsewhere keeps its own: an mmssl MAE's is ImageNet's.
        image_std: per-channel normalisation std, likewise.
        flip: FLIP's patch masking and unmasked tuning (:class:`~mmssl.models.flip.Flip`).
        lock: tower locking, LiT (:class:`~mmssl.models.locking.LockOptions`).
        distill: distillation from a frozen teacher, online or stored embeddings (docs/distill.md,
            :class:`~mmssl.models.distill.Distillation`).
        lora: LoRA adapters ``{r, alpha, dropout, target_modules, towers, trainable}`` on the
            towers of the ``pretrained`` model (``mmssl.models.lora``); ``None``: none.
        objectives: what is trained, by name, each ``{weight, start}`` (``start``: a step, or a
            fraction of the run below 1, before which the term weighs 0): ``contrastive`` (always
            there; weight 1 by default), ``caption`` (weight 2, CoCa's; needs a model with a
            caption decoder), ``mlm`` and ``itm`` (need the heads of a preset that builds them:
            :class:`~mmssl.models.clip_mlm.CLIPMLM`). ``None``: the contrastive loss alone. With
            several, each weighted term is logged as ``train/<name>_loss`` and each unweighted
            validation figure as ``val/<name>_loss``.
    """

    # Keys of configs and checkpoints written before the parts became config groups (mmssl.renames).
    renamed_args = {**FLIP_RENAMES, **LOCK_RENAMES, **DISTILL_RENAMES}

    def __init__(
        self,
        model_name: str = "ViT-B-32",
        pretrained: Optional[str] = None,
        loss: Literal["clip", "siglip"] = "clip",
        init_logit_scale: Optional[float] = None,
        init_logit_bias: Optional[float] = None,
        logit_scale_max: float = 100.0,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        warmup_steps: int = 2000,
        min_lr_ratio: float = 0.0,
        no_weight_decay: Optional[list[str]] = None,
        layer_decay: Union[float, dict[str, float], None] = None,
        tokenizer: Optional[str] = None,
        trim_text_padding: Optional[bool] = None,
        contrastive_chunk_size: Optional[int] = None,
        grad_checkpointing: bool = False,
        compile: Union[bool, dict[str, Any]] = False,
        image_tower_init: Optional[str] = None,
        image_mean: Optional[tuple[float, float, float]] = None,
        image_std: Optional[tuple[float, float, float]] = None,
        flip: Flip = Flip(),
        lock: LockOptions = LockOptions(),
        distill: Distillation = Distillation(),
        lora: Optional[dict[str, Any]] = None,
        objectives: Optional[dict[str, Optional[dict[str, Any]]]] = None,
    ) -> None:
        super().__init__()
        flip = as_group(Flip, flip, "model.init_args.flip")
        lock = as_group(LockOptions, lock, "model.init_args.lock")
        distill = as_group(Distillation, distill, "model.init_args.distill")
        self.save_hyperparameters(ignore=["optimizer"])
        self.save_hyperparameters(plain_groups(self.hparams))  # groups as dicts: a checkpoint holds data only
        if loss not in LOSS_INIT:
            raise ValueError(f"model.loss: {loss!r} is not one of {sorted(LOSS_INIT)}")
        if (objectives or {}).get("contrastive") and "loss" in objectives["contrastive"]:
            raise ConfigError("model.init_args.objectives.contrastive.loss: set model.init_args.loss instead "
                              "(it also decides the model's logit scale and bias)")
        built = build_objectives(objectives or {}, {"contrastive": {"loss": loss}})
        if pretrained is not None and not checkpoint_exists(pretrained):
            raise FileNotFoundError(f"model.pretrained: no checkpoint file at {pretrained!r}")
        check_warmup("model.warmup_steps", warmup_steps)
        self.layer_decay = check_layer_decay("model.init_args.layer_decay", layer_decay, tuple(CLIP_TOWERS))
        if contrastive_chunk_size is not None and contrastive_chunk_size < 1:
            raise ValueError(f"model.contrastive_chunk_size must be >= 1 (or null), got {contrastive_chunk_size}")
        whole = [n for n, o in built.items() if not o.chunked and o.weight > 0]
        if contrastive_chunk_size is not None and whole:
            raise ConfigError(f"model.init_args.contrastive_chunk_size: the objective(s) {whole} read the whole "
                              "batch's outputs at once, which GradCache's chunks do not keep; leave it unset")
        name = resolve_model_name(model_name)
        self.model = self._towers(name, pretrained, loss, init_logit_scale, init_logit_bias, image_mean, image_std)
        check_parts(built, self.model, model_name)
        for objective in built.values():
            objective.bind(self.model)
        # Objectives hold no persistent state; only SigLIP 2's late terms hold parameters (their heads and
        # mask token, under objectives.<name>.*), so without them the checkpoint keys stay the model's.
        self.objectives: Mapping[str, Objective] = nn.ModuleDict(built)
        # An objective that reads the joint forward (a decoder over the image tokens) runs it.
        self._joint = any(o.joint and o.weight > 0 for o in built.values())
        if image_tower_init:
            init_image_tower(self.model, image_tower_init)
        lock_towers(self.model, lock)
        enable_lora(self, lora, clip_towers(self.model),
                    {"pretrained": pretrained, "image_tower_init": image_tower_init},
                    "pretrained", CLIP_TRAINABLE)
        self.flip_options = flip
        if flip.mask_ratio is None:
            vision_cfg = open_clip.get_model_config(name)["vision_cfg"]
            flip = dataclasses.replace(flip, mask_ratio=float(vision_cfg.get("patch_dropout", 0.0)))
        self.flip = install_flip_masking(self.model.visual, flip.mask_ratio)
        self.image_mask_ratio = flip.mask_ratio
        apply_memory_options(self.model, grad_checkpointing, compile)  # after FLIP patched the image tower
        # Read by the data module (linked by the CLI): it trims each batch before the transfer.
        self.trim_text_padding: bool = self._trimming(model_name, trim_text_padding)
        self._tokenizer: Optional[Callable] = None
        self._model_config_name, self._tokenizer_dir = name, tokenizer
        size = self.model.visual.image_size
        self.image_size: int = size[0] if isinstance(size, (tuple, list)) else int(size)
        self.image_mean: tuple[float, ...] = tuple(self.model.visual.image_mean)
        self.image_std: tuple[float, ...] = tuple(self.model.visual.image_std)
        self.embed_dim: int = int(open_clip.get_model_config(name)["embed_dim"])
        self.loss_name = loss
        self.optimizer = optimizer
        self.warmup_steps, self.min_lr_ratio = warmup_steps, min_lr_ratio
        self.logit_scale_max = logit_scale_max
        self.contrastive_chunk_size = contrastive_chunk_size
        # open_clip_train/main.py: exclude = p.ndim < 2 or "bn"/"ln"/"bias"/"logit_scale" in n.
        self.no_weight_decay = list(OPEN_CLIP_NO_DECAY if no_weight_decay is None else no_weight_decay)
        install_scalar_hooks(self)  # checkpoints keep open_clip's 0-d scalars (1-D when sharded)
        self.distiller = build_distiller(self.embed_dim, distill)
        self.teacher_embeddings = distill.embeddings  # linked to the data module by the CLI
        if self.distiller is not None:
            self.hparams["distill"]["embed_dim"] = self.distiller.teacher_dim
        self._add_parts()
        # The objectives' host parts (a preset's heads) and what they check of the whole module.
        check_parts(built, self.model, model_name, host=self)
        self._param_ndim = record_shapes(self)  # before any FSDP flattening (mmssl.optim)
        # Each parameter's LR multiplier, by name (decided before wrapping, as the decay groups are).
        self._lr_scales = layer_scales(self._param_ndim, CLIP_TOWERS, self.layer_decay) if self.layer_decay else None
        unmatched = unmatched_patterns(no_weight_decay or [], self._param_ndim)
        if unmatched:
            rank_zero_warn(f"model.no_weight_decay: {unmatched} match no parameter of {model_name!r}")
        self.validation = RetrievalValidation(self.embed_dim)

    def _add_parts(self) -> None:
        """A preset's own parts beside the towers (heads its objectives read), registered after every
        part of CLIP's (their place in the checkpoint and the optimizer's order) and before the
        objectives are checked against them. CLIP has none."""

    @staticmethod
    def _towers(name: str, pretrained: Optional[str], loss: str, init_logit_scale: Optional[float],
                init_logit_bias: Optional[float], image_mean: Optional[tuple], image_std: Optional[tuple]):
        """open_clip's model of config ``name``, from ``pretrained`` or random, with the loss's scalars."""
        init = CLIP._init_kwargs(loss, init_logit_scale, init_logit_bias)
        norm = {k: tuple(v) for k, v in (("mean", image_mean), ("std", image_std)) if v is not None}
        model = create_model(name, pretrained=pretrained, output_dict=True, **init,
                             **({"force_preprocess_cfg": norm} if norm else {}))
        if pretrained is None and isinstance(model, open_clip.CoCa):
            # open_clip 3.3's MultimodalTransformer leaves its text_projection as torch.empty memory
            # (zeros when fresh pages back it, else garbage: caption losses of 1e12 in a test); its
            # init_parameters, which would set it, is never called and fails if called (it reads a
            # `transformer` attribute the class lacks). Its intended value: normal, std width ** -0.5.
            decoder = model.text_decoder
            torch.nn.init.normal_(decoder.text_projection, std=decoder.width ** -0.5)
        bias = init.get("init_logit_bias")
        if pretrained is not None and bias is not None and not checkpoint_has(pretrained, "logit_bias"):
            # open_clip fills a missing bias with 0 (its issue 712); SigLiT from a CLIP file wants b.
            with torch.no_grad():
                model.logit_bias.fill_(bias)
        return model

    def _trimming(self, model_name: str, requested: Optional[bool]) -> bool:
        """Whether the text tower runs on trimmed padding (see ``trim_text_padding``)."""
        inert = text_padding_is_inert(self.model)
        if requested and not inert:
            raise ValueError(
                f"model.trim_text_padding: the text tower of {model_name!r} is not causal with end-of-text "
                "pooling, so trimming its padding would change its output; leave it unset or false"
            )
        return inert if requested is None else requested

    @property
    def tokenizer(self) -> Callable:
        """open_clip's tokenizer for the model config, built on first use: text -> (B, L) ids."""
        if self._tokenizer is None:
            self._tokenizer = build_tokenizer(self._model_config_name, self._tokenizer_dir)
        return self._tokenizer

    @property
    def teacher_text_tokenizer(self) -> Optional[Callable]:
        """The online teacher's tokenizer when its ids differ from the student's (the data module
        then tokenises twice), else ``None``."""
        teacher = self.distiller.teacher if self.distiller is not None else None
        if teacher is None or teacher.signature == tokenizer_signature(self._model_config_name, self._tokenizer_dir):
            return None
        return teacher.tokenizer

    @staticmethod
    def _init_kwargs(loss: str, scale: Optional[float], bias: Optional[float]) -> dict[str, float]:
        """open_clip ``CLIP(init_logit_scale=, init_logit_bias=)`` for the chosen loss."""
        default_scale, default_bias = LOSS_INIT[loss]
        kwargs = {"init_logit_scale": default_scale if scale is None else scale}
        bias = default_bias if bias is None else bias
        if bias is not None:
            kwargs["init_logit_bias"] = bias
        return kwargs

    # Named stages, what callbacks and exports call ------------------------------------------------

    def encode_image(self, images: Tensor, normalize: bool = True) -> Tensor:
        """(B, 3, H, W) images -> (B, D) embeddings (masked only in training mode with FLIP)."""
        return self.model.encode_image(images, normalize=normalize)

    def encode_text(self, tokens: Tensor, normalize: bool = True) -> Tensor:
        """(B, L) token ids -> (B, D) embeddings; ``L`` may be shorter than the context when
        ``trim_text_padding`` is on (CPU tokens are trimmed here; the data module trims
        training and validation batches before they reach an accelerator)."""
        model = self.model
        if not self.trim_text_padding:
            return model.encode_text(tokens, normalize=normalize)
        if tokens.device.type == "cpu":
            # Free on CPU; on GPU it would wait for the device. Not a duplicate of the data module's
            # trim: that one covers the batches bound for an accelerator (never trimmed here), this
            # one the tokens that come from elsewhere, padded to the context (zero-shot prompts,
            # evaluation.runner, visualize.similarity, tools); a batch trimmed there is a no-op here.
            tokens = trim_text_padding(tokens)
        length = tokens.shape[1]
        if length == model.context_length:
            return model.encode_text(tokens, normalize=normalize)
        # open_clip's public encode_text always adds all context_length positions.
        return open_clip_encode_text_prefix(model, tokens, normalize=normalize)

    # Probe hooks: the protocol of
    # mmssl.evaluation.features, over open_clip's VisionTransformer.forward_intermediates.

    def forward_features(self, images: Tensor) -> Tensor:
        """Image-tower tokens after the final norm (``ln_post``): (B, 3, H, W) -> (B, 1+L, D)."""
        return self._visual_intermediates(images, indices=1, norm=True)[-1]  # indices=1: last block

    def forward_intermediates(self, images: Tensor, pool: str = "cls", norm: bool = False) -> list[Tensor]:
        """Pooled (B, D) output of every image-tower block, block 1 first (``pool``: cls / avg)."""
        if pool not in ("cls", "avg"):
            raise ValueError(f"pool must be 'cls' or 'avg', got {pool!r}")
        tokens = self._visual_intermediates(images, norm=norm)
        return [t[:, 0] if pool == "cls" else t[:, 1:].mean(dim=1) for t in tokens]

    def _visual_intermediates(self, images: Tensor, indices=None, norm: bool = False) -> list[Tensor]:
        visual = self.model.visual
        if not hasattr(visual, "forward_intermediates"):
            raise TypeError(f"image tower {type(visual).__name__} has no forward_intermediates (needs a ViT)")
        out = visual.forward_intermediates(
            images, indices=indices, normalize_intermediates=norm, intermediates_only=True,
            output_fmt="NLC", output_extra_tokens=True,
        )
        # open_clip returns the cls token and the patch tokens apart: (B, 1, D) + (B, L, D).
        return [torch.cat([cls, patches], dim=1) for cls, patches in
                zip(out["image_intermediates_prefix"], out["image_intermediates"])]

    def forward(self, images: Tensor, tokens: Tensor, local_crops: Optional[Tensor] = None,
                patch_mask: Optional[Tensor] = None, teacher_targets: bool = False,
                mae_noise: Optional[Tensor] = None) -> dict[str, Any]:
        """The step's outputs (below), with what the image-only objectives read
        (:mod:`mmssl.objectives.self_distill`, :mod:`mmssl.objectives.masked_features`), through this
        one forward so that a sharded model gathers its weights as for any step: ``local_crops``
        (B, n, 3, H, W) adds ``local_features`` (B * n, E) (the unnormalised image embeddings of
        the crops, sample-major); ``patch_mask`` (B, L) bool adds ``masked_patches`` (B, L, D)
        (:meth:`masked_patch_tokens`); ``teacher_targets`` returns only the image tower's
        ``pooled`` (B, E) and ``patches`` (B, L, D) of ``images`` (what an EMA teacher gives);
        ``mae_noise`` (B, L) adds MAE's reconstruction (:meth:`masked_reconstruction`).

        Otherwise returns ``image_features`` (B, D), ``text_features`` (B, D), ``logit_scale`` () and,
        for SigLIP, ``logit_bias`` (): open_clip's ``output_dict`` (scale already exponentiated);
        with an objective that reads the joint forward, also the decoder's ``logits`` (B, L-1, V)
        and ``labels`` (B, L-1) (open_clip ``CoCa.forward``).

        In training mode with ``contrastive_chunk_size`` the features come chunk by chunk with
        their activations rebuilt in the backward (GradCache): the same values and gradients; a
        joint forward's chunks keep, instead of their logits, what each objective keeps of them
        (``chunks``: name -> one tensor per chunk)."""
        if teacher_targets:
            return self.image_targets(images)
        out = self._pair_forward(images, tokens)
        if local_crops is not None:
            out["local_features"] = self.encode_image(local_crops.flatten(0, 1), normalize=False)  # (B * n, E)
        if patch_mask is not None:
            out["masked_patches"] = self.masked_patch_tokens(images, patch_mask)
        if mae_noise is not None:
            out.update(self.masked_reconstruction(images, mae_noise))
        return out

    def _pair_forward(self, images: Tensor, tokens: Tensor) -> dict[str, Any]:
        if self._joint:
            return self._joint_forward(images, tokens)
        if self.training and self.contrastive_chunk_size is not None:
            image, text = cached_features(self._encode_pair, images, tokens, self.contrastive_chunk_size)
        else:
            image, text = self.encode_image(images), self.encode_text(tokens)
        out = {"image_features": image, "text_features": text, "logit_scale": self.model.logit_scale.exp()}
        if self.model.logit_bias is not None:
            out["logit_bias"] = self.model.logit_bias
        return out

    def image_targets(self, images: Tensor) -> dict[str, Tensor]:
        """The EMA teacher's view: :func:`mmssl.models.tower_passes.image_targets` of the image tower."""
        return tower_passes.image_targets(self.model.visual, images)

    def mask_patches(self, noise: Tensor, mask_ratio: float) -> Tensor:
        """(B, L) uniforms -> (B, L) bool, True where a patch is masked: MAE's random masking
        (:func:`mmssl.models.masking.random_masking`, the smallest noise kept)."""
        return random_masking(noise.unsqueeze(-1), mask_ratio, noise=noise).mask.bool()

    def masked_patch_tokens(self, images: Tensor, patch_mask: Tensor) -> Tensor:
        """:func:`mmssl.models.tower_passes.masked_patch_tokens` with the mask token of the objective
        that owns one, read here, inside the forward, so a sharded module uses its gathered value."""
        token = next(o.mask_token for o in self.objectives.values() if getattr(o, "mask_token", None) is not None)
        return tower_passes.masked_patch_tokens(self.model.visual, images, patch_mask, token)

    def masked_reconstruction(self, images: Tensor, noise: Tensor) -> dict[str, Tensor]:
        """:func:`mmssl.models.tower_passes.masked_reconstruction` with the ``masked_image`` objective's
        ratio and decoder, read here, inside the forward, so a sharded module uses its gathered weights."""
        objective = self.objectives["masked_image"]
        return tower_passes.masked_reconstruction(self.model.visual, images, noise, objective.mask_ratio,
                                                  objective.decoder)

    def _encode_pair(self, images: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """(b, 3, H, W), (b, L) -> (b, D) image and (b, D) text features: one GradCache chunk."""
        return self.encode_image(images), self.encode_text(tokens)

    def _joint_forward(self, images: Tensor, tokens: Tensor) -> dict[str, Any]:
        """open_clip's joint forward (``model(images, tokens)``), GradCache-chunked in training."""
        chunk = self.contrastive_chunk_size
        if not (self.training and chunk is not None and images.shape[0] > chunk):
            return self.model(images, tokens)
        keeping = [name for name, o in self.objectives.items() if o.joint]
        parts = [checkpoint(self._joint_chunk, i, t, use_reentrant=False, preserve_rng_state=True)
                 for i, t in zip(images.split(chunk), tokens.split(chunk))]  # K x ((b, D), (b, D), kept...)
        out = {"image_features": torch.cat([p[0] for p in parts]), "text_features": torch.cat([p[1] for p in parts]),
               "logit_scale": self.model.logit_scale.exp(),
               "chunks": {name: [p[2 + k] for p in parts] for k, name in enumerate(keeping)}}
        if getattr(self.model, "logit_bias", None) is not None:
            out["logit_bias"] = self.model.logit_bias
        return out

    def _joint_chunk(self, images: Tensor, tokens: Tensor) -> tuple[Tensor, ...]:
        """One GradCache chunk of the joint forward: (b, D) image and text features, then what each
        joint objective keeps of the chunk's output (:meth:`mmssl.objectives.Objective.chunk`)."""
        out = self.model(images, tokens)
        kept = [o.chunk(out) for o in self.objectives.values() if o.joint]
        return (out["image_features"], out["text_features"], *kept)

    # Loss ----------------------------------------------------------------------------------------

    def contrastive_loss(self, out: dict[str, Tensor]) -> Tensor:
        """This rank's share of the global-batch contrastive loss from ``forward``'s output
        (:func:`mmssl.objectives.contrastive_loss`, unweighted)."""
        return contrastive_loss(out, self.loss_name)

    def losses(self, images: Tensor, tokens: Tensor) -> tuple[Tensor, ...]:
        """Each objective's weighted term of one training batch, in order (``contrastive`` first):
        their sum is the step's loss without distillation. Outside a trainer every term counts."""
        out, batch = self.step_forward({"image": images, "text": tokens}, training=True)
        return tuple(self.objective_terms(out, batch).values())

    def objective_terms(self, out: dict[str, Any], batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """Each objective's weighted term of this training step, in the order they are summed."""
        step, total = self._step_and_total()
        return {name: objective(out, batch, objective.weight_at(step, total))
                for name, objective in self._present().items()}

    def _step_and_total(self) -> tuple[int, int]:
        """This optimizer step and the run's steps (0 where no objective starts at a fraction)."""
        trainer = attached_trainer(self)
        step = trainer.global_step if trainer is not None else 0
        total = int(trainer.estimated_stepping_batches) if trainer is not None and any(
            isinstance(o.start, float) for o in self.objectives.values()) else 0
        return step, total

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        """Before an objective's start, its own parameters (a head, a mask token, MAE's decoder) sit
        out the optimizer step: their gradients, 0 while the term weighs 0, are dropped, so the
        optimizer neither decays them nor starts their state. At the start they are as initialised
        and their optimizer state begins there, as SigLIP 2 (sec. 2.3) initialises its heads, mask
        token "and corresponding optimizer parameters" at the switch; weight decay over the first
        80% of a long run would otherwise shrink them to nothing (e^-60 for
        configs/siglip2/vit_b16.yaml) before their term counts. The model's own parts (a caption
        decoder) train from the first step."""
        step, total = self._step_and_total()
        for objective in self.objectives.values():
            if objective.weight > 0 and objective.weight_at(step, total) == 0:
                for param in objective.parameters():
                    param.grad = None

    def sharding_refusal(self) -> Optional[str]:
        """Why this model cannot be sharded with FSDP2: LoRA's reason, else the first objective in
        use that refuses it (``Objective.unsharded``), naming its key."""
        refusal = super().sharding_refusal()
        if refusal:
            return refusal
        return next((f"model.init_args.objectives.{name}: {o.unsharded}" for name, o in self._present().items()
                     if o.weight > 0 and o.unsharded), None)

    def _present(self) -> dict[str, Objective]:
        """The objectives whose parts the module has (a 0-weighted one too: it runs, weighted 0, and
        its validation figures are still logged), in order."""
        return {n: o for n, o in self.objectives.items() if has_parts(o, self.model, self)}

    def step_forward(self, batch: dict[str, Tensor], training: bool) -> tuple[dict[str, Any], dict[str, Tensor]]:
        """The forward of one step and the batch its objectives score: each objective first adds
        to the batch what it prepares (:meth:`mmssl.objectives.Objective.prepare`: corrupted
        captions, their targets, its random draws) and the forward reads its ``inputs``.

        Every draw comes from one per-sample stream, cut in the objectives' order
        (:meth:`uniforms`), so adding an objective after another leaves the other's draws alone.
        Without a draw or an input (CLIP, CoCa) this is ``self(image, text)``.
        """
        present = list(self._present().values())
        widths = [o.draws(batch, training) for o in present]
        uniforms = self.uniforms(batch["image"], sum(widths), training) if sum(widths) else None
        batch, inputs, first = dict(batch), {}, 0
        for objective, width in zip(present, widths):
            drawn = uniforms[:, first:first + width] if width else None  # (B, width)
            first += width
            added = objective.prepare(self, batch, drawn, training)
            batch.update(added)
            inputs.update({k: added[k] for k in objective.inputs})
        return self(batch["image"], batch["text"], **inputs), batch

    def uniforms(self, images: Tensor, width: int, training: bool) -> Tensor:
        """(B, width) uniforms of this rank's samples for the objectives' draws of this step.

        Training: each sample's row seeded by (run seed, step, its index in the global batch)
        (:func:`mmssl.objectives.sample_uniforms`): N ranks draw what one process draws on the
        concatenated batch, and a resumed run what the uninterrupted one drew. Validation: each
        row from the sample's pixels (:func:`mmssl.models.masking.sample_noise`, seed 1), with no
        step and no collective, so a sample is scored alike whichever rank or batch it is in.
        """
        if not training:
            return sample_noise(images, width, seed=1)
        trainer = attached_trainer(self)
        step = trainer.global_step if trainer is not None else 0
        batch = images.shape[0]
        return sample_uniforms(int(os.environ.get("PL_GLOBAL_SEED", 0)), step, rank() * batch, batch, width,
                               images.device)

    # Training ----------------------------------------------------------------------------------

    def configure_model(self) -> None:
        # FSDP 1 and FSDP2 shard along dim 0 and refuse 0-d parameters ("FSDP doesn't support
        # scalar parameters"), and open_clip's logit_scale / logit_bias are 0-d: Lightning calls
        # this hook before it wraps the model (FSDP 1) or for the model to shard itself (FSDP2).
        trainer = attached_trainer(self)
        if trainer is not None and is_sharded(trainer.strategy):
            self.scalars_as_vectors()
        shard_model(self, trainer)  # FSDP2: each tower block a unit, then the root (mmssl.sharding)

    def scalars_as_vectors(self) -> None:
        """``logit_scale`` / ``logit_bias`` of shape (1,), as sharding needs (:mod:`mmssl.models.scalars`)."""
        scalars_as_vectors(self.model)

    def setup(self, stage: str) -> None:
        # What the objectives need of the run (an EMA callback, a batch field), refused before any step.
        for objective in self._present().values():
            if objective.weight > 0:
                objective.check_run(self.trainer, stage)

    def on_fit_start(self) -> None:
        seed_per_rank(self.global_rank, self.trainer.world_size)  # each rank draws its own FLIP masks and dropout

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # FLIP's unmasked tuning: whole images for the final ``flip.unmasked_tune_steps`` steps.
        if self.flip_options.unmasked_tune_steps:
            total = int(self.trainer.estimated_stepping_batches)
            self.flip.ratio = self.flip_options.ratio_at(self.trainer.global_step, total, self.image_mask_ratio)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        out, batch = self.step_forward(batch, training=True)
        terms = self.objective_terms(out, batch)
        names = list(terms)
        loss = terms[names[0]]
        if self.distiller is not None:  # its own terms beside the contrastive one, with their weights
            targets = self.distiller.targets(batch, self.image_mean, self.image_std, self.contrastive_chunk_size)
            loss, distilled = self.distiller(out, terms["contrastive"], *targets)
            terms = {**terms, **distilled}
        for name in names[1:]:
            loss = loss + terms[name]
        if len(terms) == 1:
            terms = {}  # train/loss is the one term
        self.log("train/loss", loss, prog_bar=True)
        if logging_step(attached_trainer(self)):
            for name, value in terms.items():
                self.log(f"train/{name}_loss", value.detach())  # the weighted term
            for objective in self._present().values():
                objective.log_training(self)  # train/mlm_top1, ...
            # Lightning keeps a step's metrics only on its logging steps (log_every_n_steps), and each
            # `self.log` costs ~1 ms: log the slow-moving values only where they are kept.
            self.log("train/logit_scale", self.model.logit_scale.exp().detach())
            if self.model.logit_bias is not None:
                self.log("train/logit_bias", self.model.logit_bias.detach())
            self.log("train/image_mask_ratio", float(self.flip.ratio))
        return loss

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)  # LoraCheckpoint: adapters only, and the base reference
        if self.distiller is not None:  # the teacher's file and checksum, never its weights
            checkpoint["teacher"] = self.distiller.provenance()
        record_scalar_keys(self.model, checkpoint)  # a sharded checkpoint's (1,) scalars, named

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # CLIP sec. 2.5: the temperature is clipped so logits are scaled by at most 100.
        with torch.no_grad():
            self.model.logit_scale.clamp_(0, math.log(self.logit_scale_max))

    def configure_optimizers(self) -> dict:
        optimizer = build_optimizer(self.optimizer, self, self.no_weight_decay, self._param_ndim, self._lr_scales)
        total = self.trainer.estimated_stepping_batches
        scheduler = warmup_cosine(optimizer, self.warmup_steps, total, self.min_lr_ratio,
                                  second_phase=self.flip_options.tuning_phase())
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # Validation: loss per rank, retrieval over the whole held-out set ------------------------------

    def on_validation_epoch_start(self) -> None:
        self.validation.reset()

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        # No collective here: a rank may have no validation batch. Draws come from each sample's
        # pixels (``uniforms``), so a sample is scored alike whichever rank or batch it lands in.
        out, batch = self.step_forward(batch, training=False)  # eval mode: unmasked images
        # Each objective's term of the batch (the contrastive one against the batch's own
        # negatives), weighted as in training into val/loss; each term kept by its objective.
        loss = None
        for objective in self._present().values():
            term = objective.weight * objective.validation(out, batch)
            loss = term if loss is None else loss + term
        self.validation.update(out["image_features"], out["text_features"], loss)

    def on_validation_epoch_end(self) -> None:
        self.validation.log_to(self)  # val/loss, val/i2t_R@k, val/t2i_R@k over every rank's features
        for objective in self._present().values():
            if len(self.objectives) > 1:
                objective.log_validation(self)  # val/<name>_loss, ...
            else:
                for metric in objective.children():
                    metric.reset()  # val/loss is the one term
