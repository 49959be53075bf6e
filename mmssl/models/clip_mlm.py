"""CLIP + masked language modelling + image-text matching (FLAVA / ALBEF style): a preset.

:class:`CLIPMLM` is :class:`mmssl.models.clip.CLIP` (its towers, contrastive or SigLIP loss, FLIP,
locking, distillation, retrieval validation, optimizer and schedule, its training and validation
steps) over a *bidirectional* text tower (open_clip ``text_cfg.no_causal_mask: true``), with two
heads and two more objectives on by default:

* **MLM** (:class:`mmssl.objectives.MaskedLanguageModelling`, BERT sec. 3.1, FLAVA's unimodal MLM):
  15% of each caption's tokens chosen and corrupted 80/10/10 in this model's vocabulary
  (:meth:`CLIPMLM.mask_captions`; the mask token is one more row of the token embedding), predicted
  by :class:`MLMHead` (BERT's ``BertLMPredictionHead``) from the token states of the corrupted caption.
* **ITM** (:class:`mmssl.objectives.ImageTextMatching`, ALBEF sec. 3.2): is this caption this image's?
  :class:`ITMHead` fuses a caption with the image tower's tokens, over the B positives and 2B hard
  negatives drawn from the gathered batch.

Loss ``contrastive + mlm_weight * mlm + itm_weight * itm`` (ALBEF and FLAVA: 1:1:1), exact under DDP
(each objective's docstring says how; tests/models/test_clip_mlm.py: 2 gloo processes, loss terms and
gradients); the random draws of both come from one per-sample stream seeded by (seed, step, global
sample index), masking first (``CLIP.uniforms``), so they do not depend on the number of ranks or on
resuming. The heads are this module's (``mlm_head.*``, ``itm_head.*`` in its checkpoints); the
objectives read them (``host_parts``).

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

from typing import Any, Optional

import torch
import torch.nn.functional as F
from open_clip.transformer import VisionTransformer
from torch import Tensor, nn

from mmssl.errors import ConfigError
from mmssl.models.clip import CLIP
from mmssl.models.token_masking import BertMasking, bert_masking, check_share, mask_vocabulary, padding_after_eot
from mmssl.objectives import pick_negatives, sample_uniforms

__all__ = ["CLIPMLM", "ITMHead", "MLMHead", "pick_negatives", "sample_uniforms"]  # the last two: objectives'


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


class CLIPMLM(CLIP):
    """CLIP's contrastive (or SigLIP) loss plus masked language modelling and image-text matching.

    A preset: the heads (``mlm_head``, ``itm_head``) and the objectives ``contrastive``, ``mlm`` and
    ``itm`` with the weights and shares below; training, validation and logging are CLIP's. Logged:
    ``train/loss``, ``train/<name>_loss`` (each objective's *weighted* term), ``train/mlm_top1`` and
    ``train/captions_without_target`` (this rank's chosen tokens), ``train/itm_accuracy``;
    ``val/loss`` (the weighted sum), ``val/contrastive_loss``, ``val/mlm_loss``, ``val/itm_loss`` (each
    *unweighted*), ``val/mlm_top1``, ``val/itm_accuracy``, and CLIP's retrieval figures.

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
            SigLIP's loss; ``objectives``: more objectives, or the starts and options of these three
            over the arguments above). GradCache is refused (MLM and ITM read the whole batch), and
            LoRA (its checkpoints keep the adapters, not the heads).
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
        if clip_args.get("lora") is not None:
            raise ConfigError("model.init_args.lora: CLIPMLM's heads train whole, and a LoRA checkpoint keeps the "
                              "adapters only (the heads would be lost); leave it unset")
        asked = clip_args.pop("objectives", None)
        given = dict(asked or {})
        mlm = {"weight": mlm_weight, "mask_ratio": mlm_mask_ratio, "mask_share": mlm_mask_share,
               "random_share": mlm_random_share}
        objectives = {"contrastive": given.pop("contrastive", None) or {},
                      "mlm": {**mlm, **(given.pop("mlm", None) or {})},
                      "itm": {"weight": itm_weight, **(given.pop("itm", None) or {})}, **given}
        self._itm_heads = itm_heads  # read by _add_parts, inside CLIP's constructor
        super().__init__(model_name=model_name, objectives=objectives, **clip_args)
        self.hparams["objectives"] = asked  # what was asked: the weights above are hyper-parameters already

    def _add_parts(self) -> None:
        """The heads, after CLIP's parts (so the checkpoint and optimizer orders are those CLIPMLM
        always had): BERT's MLM head tied to the token embedding, and the ITM fusion head."""
        if not isinstance(self.model.visual, VisionTransformer):
            raise ConfigError(f"model.init_args.model_name: the image tower of {self.hparams['model_name']!r} is "
                              f"{type(self.model.visual).__name__}; ITM reads the tokens of an open_clip ViT")
        vocab = int(self.model.token_embedding.num_embeddings)
        self.vocabulary = mask_vocabulary(self.tokenizer, vocab)
        self.mlm_head = MLMHead(int(self.model.token_embedding.embedding_dim), vocab)
        heads = self._itm_heads or max(1, self.embed_dim // 64)
        if self.embed_dim % heads:
            raise ConfigError(f"model.init_args.itm_heads: {heads} does not divide embed_dim {self.embed_dim}")
        self.itm_head = ITMHead(self.embed_dim, int(self.model.visual.transformer.width), heads)

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

    def mask_captions(self, tokens: Tensor, noise: Tensor, ratio: float = 0.15, mask_share: float = 0.8,
                      random_share: float = 0.1) -> BertMasking:
        """BERT's corruption of (B, L) captions from (B, L, 3) uniforms in this model's vocabulary (its
        mask token; start/end-of-text and padding never chosen): ``ratio`` of each caption's maskable
        tokens chosen, ``mask_share`` of those masked, ``random_share`` replaced (BERT: 0.15, 80/10/10).
        The masked-words objective's stage (:class:`mmssl.objectives.MaskedLanguageModelling`)."""
        voc = self.vocabulary
        padding = padding_after_eot(tokens, voc.eot_id) if voc.eot_id is not None else None
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
