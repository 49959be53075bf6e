"""CoCa (Yu et al. 2022, "CoCa: Contrastive Captioners are Image-Text Foundation Models") over
open_clip's own ``CoCa`` model: a preset of :class:`mmssl.models.clip.CLIP` with captioning on.

open_clip builds the image tower (attentional pooling: one contrastive query and
``attn_pooler_queries`` tokens for the decoder), the unimodal text tower (a class token appended
for the contrastive embedding) and the multimodal text decoder, from any CoCa config it knows
(``coca_ViT-B-32``, ``coca_ViT-L-14``) or a JSON file with a ``multimodal_cfg``. The loss is
``clip_loss_weight`` x the contrastive loss + ``caption_loss_weight`` x the teacher-forced next-token
cross-entropy (CoCa sec. 3.2, eq. 4): the objectives :class:`mmssl.objectives.Contrastive` and
:class:`mmssl.objectives.Captioning`, exact under DDP (their docstrings say how; open_clip's
``CoCaLoss`` computes the same, tested).
"""

from __future__ import annotations

import os
from typing import Any, Optional

import open_clip
from torch import Tensor

from mmssl.models import generation
from mmssl.models.clip import CLIP
from mmssl.models.open_clip_config import build_tokenizer, resolve_model_name


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
    """Contrastive captioner: :class:`~mmssl.models.clip.CLIP` with captioning on, over an open_clip
    CoCa config (CLIP's towers plus a multimodal decoder that reads the image tokens).

    A preset: the contrastive and the captioning objectives with CoCa's weights
    (:mod:`mmssl.objectives`), everything else CLIP's. Its own are captioning's tools
    (:meth:`generate`) and two start-up checks of the model it builds.

    Args:
        model_name: open_clip CoCa config name (``coca_ViT-B-32``) or a JSON config with a ``multimodal_cfg``.
        caption_loss_weight: weight of the captioning loss (CoCa sec. 4.1: lambda_Cap = 2;
            ``open_clip_train --coca-caption-loss-weight`` default 2.0).
        clip_loss_weight: weight of the contrastive loss (lambda_Con = 1; ``--coca-contrastive-loss-weight`` 1.0).
        **clip_args: :class:`mmssl.models.clip.CLIP`'s arguments and parts, as CLIP takes them
            (``pretrained``: a local open_clip CoCa file; ``tokenizer``: the folder of a Hugging Face
            tokenizer a config names, built before the model so a missing one is the first error;
            ``loss: siglip``: SigLIP's sigmoid loss with captioning, as SigLIP 2 trains;
            ``objectives``: their starts, and weights over the two above). ``flip`` masks the
            patches both the contrastive query and the decoder's queries pool;
            ``contrastive_chunk_size`` (GradCache) embeds and decodes chunk by chunk.
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
        built_tokenizer = build_tokenizer(name, clip_args.get("tokenizer"))  # before the model: the first error
        check_text_tower_local(name)
        asked = clip_args.pop("objectives", None)
        given = dict(asked or {})
        objectives = {"contrastive": {"weight": clip_loss_weight, **(given.pop("contrastive", None) or {})},
                      "caption": {"weight": caption_loss_weight, **(given.pop("caption", None) or {})}, **given}
        super().__init__(model_name=model_name, objectives=objectives, **clip_args)
        self.hparams["objectives"] = asked  # what was asked: the weights above are hyper-parameters already
        self._tokenizer = built_tokenizer
        self.pad_id: int = int(self.model.pad_id)

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
