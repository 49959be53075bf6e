"""CLIP + masked language modelling + image-text matching (FLAVA / ALBEF style).

:class:`CLIPMLM` is :class:`mmssl.models.clip.CLIP` (its towers, contrastive or SigLIP loss, FLIP,
locking, retrieval validation, optimizer and schedule) with two more losses:

* **MLM** (BERT, Devlin et al. 2018, sec. 3.1; FLAVA's unimodal MLM on the text encoder, ALBEF
  ``configs/Pretrain.yaml`` ``mlm_probability: 0.15``): 15% of each caption's tokens chosen, 80/10/10
  (:func:`mmssl.models.token_masking.bert_masking`; start/end-of-text and padding never chosen),
  predicted by BERT's ``BertLMPredictionHead`` from the token states of a *bidirectional* text tower
  (open_clip ``text_cfg.no_causal_mask: true``) run on the corrupted caption. The contrastive and
  matching terms read the clean caption (ALBEF ``model_pretrain.py`` encodes the unmasked text for
  both and masks a copy for MLM).
* **ITM** (ALBEF sec. 3.2, ``models/model_pretrain.py``): is this caption this image's? A binary
  head over fused features of the B positive pairs and 2B hard negatives (one image per caption, one
  caption per image), each drawn with probability ``softmax`` of the contrastive similarity over
  the other pairs of the *gathered* batch (BLIP-2 ``blip2_qformer.py`` draws from all ranks; ALBEF
  from the local one), so the negatives are those one process would draw on the concatenated batch.

Loss ``contrastive + mlm_weight * mlm + itm_weight * itm`` (ALBEF and FLAVA: 1:1:1). Exact under
DDP: the MLM token mean divides by every rank's token count (one all-reduce of a count, as CoCa's
caption loss); the ITM sum is over the pairs this rank fuses (its B positives, its images' negative
captions, and the captions of any rank whose negative image it holds: the ranks together fuse one
process's 3N pairs) divided by 3B (the same B on every rank); the random draws of both come from
per-sample generators seeded by (seed, step, global sample index), so they do not depend on the
number of ranks or on resuming (tests/models/test_clip_mlm.py: 2 gloo processes, loss terms and
gradients).

Under FSDP2 (each transformer block a unit, :mod:`mmssl.sharding`) a training or validation step
takes every network output from one root ``forward``: the text tower runs once on the clean and
the corrupted captions together, and the heads are root parameters. FSDP2 keeps the order of unit
forwards until a backward ends and prefetches by it in that backward; an evaluation run on one
rank only (uneven held-out shares: the sanity check and validation of the CLI tests give rank 1
no batch) leaves entries on that rank alone, and the first backward after it prefetches the last
unit that evaluation ran. When that is the root, gathered from forward to backward, the prefetch
does nothing; when validation ended in a text block of its own (the corrupted captions' call, as
it once did), rank 0 all-gathered that block while rank 1 reduce-scattered another, and the run
hung (tests/checkpoints/test_fsdp2_clip_mlm.py).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import open_clip
import torch
import torch.distributed as dist
import torch.nn.functional as F
from open_clip.transformer import VisionTransformer
from torch import Tensor, nn
from torchmetrics import MeanMetric

from mmssl.distributed import gather_with_grad, is_distributed, rank, world_size
from mmssl.errors import ConfigError
from mmssl.log_cadence import logging_step
from mmssl.losses import clip_loss, siglip_loss
from mmssl.models.clip import CLIP
from mmssl.models.distill import Distillation
from mmssl.models.masking import sample_noise
from mmssl.models.open_clip_config import resolve_model_name
from mmssl.models.parts import as_group
from mmssl.models.token_masking import (
    BertMasking,
    bert_masking,
    check_share,
    mask_vocabulary,
    masked_token_ce,
    padding_after_eot,
)
from mmssl.optim import record_shapes
from mmssl.upstream import attached_trainer


class MLMHead(nn.Module):
    """BERT's ``BertLMPredictionHead``: dense + GELU + LayerNorm, then the word embeddings
    (tied, as BERT's decoder) and a per-token bias: (M, W) token states -> (M, V) logits."""

    def __init__(self, width: int, vocab_size: int) -> None:
        super().__init__()
        self.dense = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.bias = nn.Parameter(torch.zeros(vocab_size))

    def forward(self, states: Tensor, embedding: Tensor) -> Tensor:
        """states (M, W), embedding (V, W) -> (M, V)."""
        return self.norm(F.gelu(self.dense(states))) @ embedding.T + self.bias


class ITMHead(nn.Module):
    """Fusion of a caption with an image and ALBEF's binary ``itm_head``: (P, D), (P, T, W) -> (P, 2).

    ALBEF ``models/model_pretrain.py`` fuses with a 6-layer encoder whose text tokens cross-attend to
    the image tokens and reads the [CLS] output. Here the text tower is already bidirectional, so its
    pooled caption embedding summarises every word, and one pre-norm block (cross-attention from that
    one query to the image tower's tokens, then an MLP) fuses: reading the image *tokens* lets the
    head check where and what ("small red square, top left") that a product of two pooled vectors,
    which the contrastive loss already scores, would not add. A block over all text positions would
    give the same output at the pooled one without self-attention after it, so one query suffices.
    """

    def __init__(self, query_dim: int, image_width: int, heads: int) -> None:
        super().__init__()
        self.norm_query = nn.LayerNorm(query_dim)
        self.norm_image = nn.LayerNorm(image_width)
        self.attn = nn.MultiheadAttention(query_dim, heads, kdim=image_width, vdim=image_width, batch_first=True)
        self.norm_mlp = nn.LayerNorm(query_dim)
        self.mlp = nn.Sequential(nn.Linear(query_dim, 4 * query_dim), nn.GELU(), nn.Linear(4 * query_dim, query_dim))
        self.head = nn.Linear(query_dim, 2)  # ALBEF itm_head: logits of (no match, match)

    def forward(self, text: Tensor, image_tokens: Tensor) -> Tensor:
        """text (P, D) caption embeddings, image_tokens (P, T, W) -> (P, 2) logits."""
        x = text.unsqueeze(1)  # (P, 1, D)
        kv = self.norm_image(image_tokens)  # (P, T, W)
        x = x + self.attn(self.norm_query(x), kv, kv, need_weights=False)[0]
        x = x + self.mlp(self.norm_mlp(x))
        return self.head(x[:, 0])  # (P, 2)


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


def sample_uniforms(seed: int, step: int, first_row: int, rows: int, width: int, device: torch.device) -> Tensor:
    """(rows, width) uniforms, row i from a generator seeded by (seed, step, first_row + i).

    The draws for a sample depend on its index in the global batch and on the step only, not on
    the number of ranks it is split over nor on a resume: one process on the concatenated batch
    draws what N ranks draw. Costs one small CPU generator per sample and step.
    """
    out = [torch.rand(width, generator=torch.Generator().manual_seed(
        ((seed * 1_000_003 + step) * 1_000_003 + first_row + i) & (2**63 - 1))) for i in range(rows)]
    return torch.stack(out).to(device) if out else torch.zeros(0, width, device=device)


def check_clip_mlm_args(clip_args: dict[str, Any]) -> None:
    """Refuse the CLIP options CLIPMLM cannot honour, naming the key."""
    distill = as_group(Distillation, clip_args.get("distill"), "model.init_args.distill")
    refused = {
        "contrastive_chunk_size": clip_args.get("contrastive_chunk_size") is not None,  # MLM/ITM read token states
        "distill": any(v is not None for v in (distill.teacher, distill.embeddings, distill.embed_dim)),
        "lora": clip_args.get("lora") is not None,
        "trim_text_padding": bool(clip_args.get("trim_text_padding")),  # a bidirectional tower reads the padding
    }
    if clip_args.get("objectives") is not None:
        raise ValueError("model.init_args.objectives: CLIPMLM trains its own list (contrastive, MLM, ITM: "
                         "mlm_weight, itm_weight), which is not composed with other objectives yet; leave it unset")
    named = [k for k, bad in refused.items() if bad]
    if named:
        raise ValueError(f"model.init_args.{named[0]}: CLIPMLM does not take it (its text tower runs on whole "
                         "captions for MLM and matching, without GradCache, distillation or LoRA); leave it unset")


class CLIPMLM(CLIP):
    """CLIP's contrastive (or SigLIP) loss plus masked language modelling and image-text matching.

    Args:
        model_name: open_clip JSON model config whose text tower is bidirectional
            (``text_cfg.no_causal_mask: true``) with one embedding row for the mask token
            (``text_cfg.vocab_size`` 49409 for open_clip's BPE); the image tower an open_clip ViT.
        mlm_weight: weight of the MLM loss, >= 0 (ALBEF, FLAVA: 1).
        itm_weight: weight of the ITM loss, >= 0 (ALBEF: 1).
        mlm_mask_ratio: share of each caption's maskable tokens chosen, in (0, 1) (BERT: 0.15).
        mlm_mask_share: share of the chosen tokens replaced by the mask token (BERT: 0.8).
        mlm_random_share: share replaced by a random token (BERT: 0.1); the rest stay.
        itm_heads: attention heads of the fusion block; ``None``: embed_dim // 64, at least 1.
        **clip_args: :class:`mmssl.models.clip.CLIP`'s arguments and parts (``loss: siglip`` for
            SigLIP's loss). GradCache, distillation, LoRA and padding trimming are refused.
    """

    def __init__(self, model_name: str = "ViT-B-32", mlm_weight: float = 1.0, itm_weight: float = 1.0,
                 mlm_mask_ratio: float = 0.15, mlm_mask_share: float = 0.8, mlm_random_share: float = 0.1,
                 itm_heads: Optional[int] = None, **clip_args: Any) -> None:
        for key, weight in (("mlm_weight", mlm_weight), ("itm_weight", itm_weight)):
            if weight < 0:
                raise ConfigError(f"model.init_args.{key} must be >= 0, got {weight}")
        if not 0.0 < mlm_mask_ratio < 1.0:
            raise ConfigError(f"model.init_args.mlm_mask_ratio must be in (0, 1), got {mlm_mask_ratio}")
        check_share("model.init_args.mlm_mask_share", mlm_mask_share)
        check_share("model.init_args.mlm_random_share", mlm_random_share, 0.0, 1.0 - mlm_mask_share)
        check_clip_mlm_args(clip_args)
        text_cfg = open_clip.get_model_config(resolve_model_name(model_name))["text_cfg"]
        if "hf_model_name" in text_cfg or not text_cfg.get("no_causal_mask", False):
            raise ValueError(f"model.init_args.model_name: the text tower of {model_name!r} is causal (each token "
                             "sees only those before it), so MLM cannot predict from both sides: set "
                             "text_cfg.no_causal_mask: true in its JSON config (an open_clip text transformer)")
        super().__init__(model_name=model_name, **clip_args)
        if not isinstance(self.model.visual, VisionTransformer):
            raise ValueError(f"model.init_args.model_name: the image tower of {model_name!r} is "
                             f"{type(self.model.visual).__name__}; ITM reads the tokens of an open_clip ViT")
        vocab = int(self.model.token_embedding.num_embeddings)
        self.vocabulary = mask_vocabulary(self.tokenizer, vocab)
        self.mlm_weight, self.itm_weight = mlm_weight, itm_weight
        self.mlm_shares = (mlm_mask_ratio, mlm_mask_share, mlm_random_share)
        self.mlm_head = MLMHead(int(self.model.token_embedding.embedding_dim), vocab)
        heads = itm_heads or max(1, self.embed_dim // 64)
        if self.embed_dim % heads:
            raise ValueError(f"model.init_args.itm_heads: {heads} does not divide embed_dim {self.embed_dim}")
        self.itm_head = ITMHead(self.embed_dim, int(self.model.visual.transformer.width), heads)
        self._param_ndim = record_shapes(self)  # CLIP recorded the shapes before the heads existed
        # Set-level figures as sums and counts over ranks (as RetrievalValidation's).
        self.val_contrastive, self.val_mlm, self.val_itm = MeanMetric(), MeanMetric(), MeanMetric()
        self.val_mlm_top1, self.val_itm_accuracy = MeanMetric(), MeanMetric()

    # Named stages ------------------------------------------------------------------------------

    def forward(self, images: Tensor, tokens: Tensor, masked_tokens: Optional[Tensor] = None) -> dict[str, Tensor]:
        """CLIP's ``image_features`` (B, D), ``text_features`` (B, D), ``logit_scale`` (and
        ``logit_bias``), plus ``image_tokens`` (B, 1+P, W): the image tower's last block after
        ``ln_post``, from the same forward (FLIP's masking, in training, drops patches of both).

        Given ``masked_tokens`` (B, L), the corrupted captions, also ``masked_states`` (B, L, W):
        their token states after ``ln_final``, from the same text-tower call as the clean captions
        (one call on the 2B captions; the tower treats each caption alone, so the figures are those
        of two calls). Training and validation take every network output from this one forward:
        each FSDP2 unit then runs once per step, and the step's last unit forward is the root's
        (why that matters: the module docstring)."""
        out = self.model.visual.forward_intermediates(images, indices=1, normalize_intermediates=True,
                                                      output_fmt="NLC", output_extra_tokens=True)
        image_tokens = torch.cat([out["image_intermediates_prefix"][-1], out["image_intermediates"][-1]], dim=1)
        result = {"image_features": F.normalize(out["image_features"], dim=-1),
                  "logit_scale": self.model.logit_scale.exp(), "image_tokens": image_tokens}
        if masked_tokens is None:
            result["text_features"] = self.encode_text(tokens)
        else:
            batch = tokens.shape[0]
            text = self.model.forward_intermediates(text=torch.cat([tokens, masked_tokens]), text_indices=1,
                                                    normalize=False)
            # The pooled features of the corrupted rows (pooled at the mask token's id) are unused.
            # Normalised here, after the split, so that no output is a view (FSDP2's pre-backward
            # hook sits on the root's outputs, and warns of views).
            result["text_features"] = F.normalize(text["text_features"][:batch], dim=-1)  # (B, D)
            result["masked_states"] = self.model.ln_final(text["text_intermediates"][-1][batch:])  # (B, L, W)
        if self.model.logit_bias is not None:
            result["logit_bias"] = self.model.logit_bias
        return result

    def forward_text_tokens(self, tokens: Tensor) -> Tensor:
        """(B, L) ids -> (B, L, W) token states of the text tower after ``ln_final`` (open_clip's
        public ``forward_intermediates``; L is the full context)."""
        return self.model.forward_intermediates(text=tokens, text_indices=1, normalize_intermediates=True,
                                                intermediates_only=True)["text_intermediates"][-1]

    def mask_captions(self, tokens: Tensor, noise: Tensor) -> BertMasking:
        """BERT's 80/10/10 corruption of (B, L) captions from (B, L, 3) uniforms."""
        voc = self.vocabulary
        padding = padding_after_eot(tokens, voc.eot_id) if voc.eot_id is not None else None
        ratio, mask_share, random_share = self.mlm_shares
        return bert_masking(tokens, voc.mask_id, voc.random_vocab, ratio, mask_share, random_share,
                            voc.never_masked, padding, noise=noise)

    def predict_masked_tokens(self, images: Tensor, tokens: Tensor, positions: Tensor) -> Tensor:
        """Logits of one word per caption replaced by the mask token: (B, V) at ``positions``.

        The MLM head reads the text tower alone (FLAVA's unimodal MLM), so ``images`` (B, 3, H, W)
        do not change the answer; they are taken so that every masked-word model is called alike.

        Args:
            images: (B, 3, H, W), unused; tokens: (B, L) ids; positions: (B,) the token to mask.
        """
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        masked = tokens.clone()
        masked[rows, positions] = self.vocabulary.mask_id
        states = self.forward_text_tokens(masked)  # (B, L, W)
        return self.mlm_head(states[rows, positions], self.model.token_embedding.weight)  # (B, V)

    def mlm_sums(self, masking: BertMasking, states: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
        """(CE sum, top-1 hits, count) over the chosen tokens of a corrupted batch.

        Args:
            masking: the corrupted (B, L) captions and their targets.
            states: (B, L, W) the text tower's states of ``masking.input_ids`` (``forward``'s
                ``masked_states``); ``None``: the tower runs on them here.
        """
        if states is None:
            states = self.forward_text_tokens(masking.input_ids)  # (B, L, W)
        logits = self.mlm_head(states[masking.selected], self.model.token_embedding.weight)  # (M, V)
        return masked_token_ce(logits, masking.labels[masking.selected])

    def itm_sums(self, out: dict[str, Tensor], tokens: Tensor, uniforms: Optional[Tensor],
                 gathered: bool) -> tuple[Tensor, Tensor, Tensor]:
        """ITM (CE sum, hits, count): this rank's B positives, the negative image of each caption of
        any rank whose negative image this rank holds, and the negative caption of each of its images.

        The image tokens stay on their rank (gathering them would move N x (1+P) x W numbers, 20 GB
        for a ViT-B/16 at a global batch of 32768): captions' embeddings (N, D) and chosen indices
        (N,) travel instead, and the sum over ranks covers the same 3N pairs as one process.

        Args:
            out: ``forward``'s output for (B, ...) images and (B, L) captions.
            tokens: (B, L) the captions, to skip a negative whose caption is the positive's
                (the same text is no negative).
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
        logits = self.itm_head(query, keys)  # (2B + K, 2)
        held_count = captions.shape[0]
        labels = torch.cat([torch.ones(batch), torch.zeros(held_count + batch)]).to(logits.device, torch.int64)
        weight = torch.cat([torch.ones(batch + held_count, device=logits.device), has_text.to(logits.dtype)])
        ce = F.cross_entropy(logits.float(), labels, reduction="none")
        hits = ((logits.argmax(dim=-1) == labels) & (weight > 0)).sum()
        return (ce * weight).sum(), hits, weight.sum()

    # Training ----------------------------------------------------------------------------------

    def _draws(self, batch: int, length: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """This rank's (B, L, 3) masking and (B, 2N) negative uniforms of this step."""
        trainer = attached_trainer(self)
        step = trainer.global_step if trainer is not None else 0
        n = batch * world_size()
        u = sample_uniforms(int(os.environ.get("PL_GLOBAL_SEED", 0)), step, rank() * batch, batch,
                            3 * length + 2 * n, device)
        return u[:, :3 * length].reshape(batch, length, 3), u[:, 3 * length:]

    def losses(self, images: Tensor, tokens: Tensor) -> dict[str, Tensor]:
        """This rank's loss terms; their mean over ranks is the loss of one process on the
        concatenated batch (module docstring). Keys: ``contrastive``, ``mlm``, ``itm`` (unweighted),
        ``loss`` (weighted sum), ``mlm_top1``, ``itm_accuracy``, ``captions_without_target``."""
        mlm_noise, neg_noise = self._draws(images.shape[0], tokens.shape[1], images.device)
        masking = self.mask_captions(tokens, mlm_noise)
        out = self(images, tokens, masking.input_ids)
        contrastive = self.contrastive_loss(out)
        ce_sum, correct, count = self.mlm_sums(masking, out["masked_states"])
        total = count.detach().clone()
        if is_distributed():
            dist.all_reduce(total)  # every rank's chosen tokens
        mlm = ce_sum * world_size() / total.clamp_min(1)  # mean over ranks: the global token mean
        itm_sum, itm_hits, itm_count = self.itm_sums(out, tokens, neg_noise, gathered=True)
        itm = itm_sum / (3 * images.shape[0])  # the same B on every rank: mean over ranks is global
        loss = contrastive + self.mlm_weight * mlm + self.itm_weight * itm
        return {"loss": loss, "contrastive": contrastive, "mlm": mlm, "itm": itm,
                "mlm_top1": correct.float() / count.clamp_min(1), "itm_accuracy": itm_hits.float() / itm_count,
                "captions_without_target": (~masking.selected.any(dim=1)).sum().float()}

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        terms = self.losses(batch["image"], batch["text"])
        self.log("train/loss", terms["loss"], prog_bar=True)
        self.log("train/captions_without_target", terms["captions_without_target"], reduce_fx="sum")
        if logging_step(attached_trainer(self)):
            for name in ("contrastive", "mlm", "itm"):
                self.log(f"train/{name}_loss", terms[name].detach())
            self.log("train/mlm_top1", terms["mlm_top1"])
            self.log("train/itm_accuracy", terms["itm_accuracy"])
            self.log("train/logit_scale", self.model.logit_scale.exp().detach())
            self.log("train/image_mask_ratio", float(self.flip.ratio))
        return terms["loss"]

    # Validation: CLIP's retrieval, masked words of held-out captions, matching -------------------

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        # No collective here: a rank may have no validation batch. Masks come from each sample's
        # pixels (masking.sample_noise) and negatives are the hardest of the rank's own batch, so
        # a sample is scored alike whichever rank or batch it lands in.
        images, tokens = batch["image"], batch["text"]
        noise = sample_noise(images, 3 * tokens.shape[1], seed=1).view(*tokens.shape, 3)  # (B, L, 3)
        masking = self.mask_captions(tokens, noise)
        out = self(images, tokens, masking.input_ids)  # eval mode: unmasked images
        image, text, scale = out["image_features"], out["text_features"], out["logit_scale"]
        if self.loss_name == "siglip":
            contrastive = siglip_loss(image, text, scale, out["logit_bias"])
        else:
            contrastive = clip_loss(image, text, scale)
        ce_sum, correct, count = self.mlm_sums(masking, out["masked_states"])
        itm_sum, itm_hits, itm_count = self.itm_sums(out, tokens, None, gathered=False)
        mlm, itm = ce_sum / count.clamp_min(1), itm_sum / (3 * images.shape[0])
        self.validation.update(image, text, contrastive + self.mlm_weight * mlm + self.itm_weight * itm)
        self.val_contrastive.update(contrastive.detach(), weight=images.shape[0])
        self.val_mlm.update(mlm.detach(), weight=count)  # token mean over the set
        self.val_mlm_top1.update(correct.float() / count.clamp_min(1), weight=count)
        self.val_itm.update(itm.detach(), weight=images.shape[0])
        self.val_itm_accuracy.update(itm_hits.float() / itm_count.clamp_min(1), weight=itm_count)

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()  # val/loss, val/i2t_R@k, val/t2i_R@k
        self.log("val/contrastive_loss", self.val_contrastive)
        self.log("val/mlm_loss", self.val_mlm)
        self.log("val/mlm_top1", self.val_mlm_top1)
        self.log("val/itm_loss", self.val_itm)
        self.log("val/itm_accuracy", self.val_itm_accuracy)
