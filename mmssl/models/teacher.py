"""A frozen image-text teacher for distillation, loaded from a local file or folder.

Any of the files mmssl writes or reads for a CLIP is a teacher:

* an mmssl ``CLIP`` Lightning checkpoint (``mmssl fit``'s ``last.ckpt``): its class is checked
  against the one table of model kinds (:data:`mmssl.checkpoints.layouts.KINDS`), its open_clip
  model rebuilt from the ``model_name`` it records and its weights converted by the table's
  ``clip_to_open_clip`` layout. Of a checkpoint trained with ``mmssl.callbacks.EMA`` the **raw**
  weights are read, as every tool reads them, unless ``ema`` asks for the average
  (:func:`mmssl.checkpoints.read.lightning_weights`, the one place that decides);
* an open_clip state dict (``tools/export.py --format open_clip``, or any open_clip release file)
  with ``teacher_model``: its open_clip model name or JSON config;
* an ``open_clip_hf`` folder (``open_clip_config.json`` + ``open_clip_model.safetensors``:
  ``tools/export.py --format open_clip_hf``, open_clip's ``push_to_hf_hub``);
* a transformers ``CLIPModel`` folder (``config.json`` + ``model.safetensors`` and the tokenizer
  files: ``tools/export.py --format hf``).

A folder's model, tokenizer and image settings are :func:`mmssl.checkpoints.folders.build_folder`'s,
the builder the evaluation encoders wrap too (:func:`mmssl.evaluation.encoders.load_encoder`).

Every weight file is read by :func:`mmssl.checkpoints.read_checkpoint` (weights only: a file that
pickles code is refused, naming it), nothing downloads, and a tokenizer that is not on disk fails
at start-up with the command that fetches it. The teacher is built once, frozen
(``requires_grad=False``) and in eval mode; the student keeps it outside its own modules, so it is
never in the student's ``state_dict``, optimizer, DDP or FSDP wrapping (its path and SHA-256 are).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Callable, Optional

import open_clip
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mmssl.checkpoints import UnsafeCheckpointError
from mmssl.checkpoints.folders import (
    HF,
    OPEN_CLIP_HF,
    TIMM,
    ImageSettings,
    build_folder,
    hf_projected,
    open_clip_image_settings,
)
from mmssl.checkpoints.model_file import LIGHTNING, ModelFile, read_model_file
from mmssl.models.lora import LORA_BASE
from mmssl.models.open_clip_config import build_tokenizer, create_model, resolve_model_name

KEY = "model.init_args.distill.teacher"


def sha256(path: str) -> str:
    """Hex SHA-256 of a teacher's weights file (what a student's checkpoint records)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tokenizer_signature(model_name: str, tokenizer_dir: Optional[str]) -> tuple:
    """What decides an open_clip config's token ids: two configs with equal signatures tokenise
    every caption alike, so the student's tokens serve the teacher (the loader tokenises once)."""
    return _text_signature(open_clip.get_model_config(model_name).get("text_cfg", {}), tokenizer_dir)


def _text_signature(text_cfg: dict, tokenizer_dir: Optional[str]) -> tuple:
    hf_name = text_cfg.get("hf_tokenizer_name")
    return ("open_clip", hf_name, os.path.abspath(tokenizer_dir) if hf_name and tokenizer_dir else None,
            int(text_cfg.get("context_length", 77)), json.dumps(text_cfg.get("tokenizer_kwargs", {}), sort_keys=True))


class Teacher(nn.Module):
    """A frozen CLIP behind two named stages: ``encode_image`` and ``encode_text``, L2-normalised.

    Args:
        model: the open_clip ``CLIP`` (or transformers ``CLIPModel`` with ``hf=True``).
        tokenizer: captions -> (B, L) token ids for this model.
        signature: see :func:`tokenizer_signature`; equal to the student's when its tokens serve.
        source: the file or folder it was read from.
        image: the input size, mean and std.
        hf: ``model`` is a transformers ``CLIPModel``.
        weights: the weights file (hashed into :attr:`sha256`); default: ``source``, a file.
    """

    def __init__(self, model: nn.Module, tokenizer: Callable, signature: tuple, source: str, image: ImageSettings,
                 hf: bool = False, weights: Optional[str] = None) -> None:
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        self.tokenizer, self.signature, self.source, self.hf = tokenizer, signature, source, hf
        self.image_size, self.image_mean, self.image_std = image
        if hf:
            self.context_length = int(model.config.text_config.max_position_embeddings)
            self.embed_dim = int(model.config.projection_dim)
        else:
            self.context_length = int(model.context_length)
            self.embed_dim = _text_embedding_width(model)
        self.sha256 = sha256(weights or source)
        self.train(False)

    def train(self, mode: bool = True) -> "Teacher":
        return super().train(False)  # always eval: dropout off, norms frozen

    @property
    def logit_scale(self) -> Tensor:
        """The teacher's (exponentiated) logit scale, a 0-d tensor."""
        return self.model.logit_scale.detach().reshape(()).exp()

    def follow(self, images: Tensor) -> None:
        """Move to the device of ``images`` and, when they are half-precision (a ``*-true``
        precision run), to their dtype: the teacher runs where and as the student runs."""
        param = next(self.model.parameters())
        dtype = images.dtype if images.dtype in (torch.float16, torch.bfloat16) else param.dtype
        if param.device != images.device or param.dtype != dtype:
            self.model.to(device=images.device, dtype=dtype)

    def encode_image(self, images: Tensor) -> Tensor:
        """(B, 3, S, S) images at the teacher's size and normalisation -> (B, Dt) unit vectors."""
        if self.hf:
            return F.normalize(hf_projected(self.model.get_image_features(pixel_values=images)), dim=-1)
        return self.model.encode_image(images, normalize=True)

    def encode_text(self, tokens: Tensor) -> Tensor:
        """(B, L) token ids, L <= the context (trimmed padding is restored) -> (B, Dt) unit vectors."""
        if tokens.shape[1] < self.context_length:  # the student's batches may be trimmed
            # open_clip pads with 0, which a bidirectional tower (a CLIP + MLM export) reads; a causal
            # tower (every transformers CLIPTextModel) never reads past the end of text, whatever the pad.
            tokens = F.pad(tokens, (0, self.context_length - tokens.shape[1]), value=0)
        if self.hf:
            return F.normalize(hf_projected(self.model.get_text_features(input_ids=tokens)), dim=-1)
        return self.model.encode_text(tokens, normalize=True)


def _text_embedding_width(model: nn.Module) -> int:
    """An open_clip CLIP's embedding width, read from its text projection as open_clip builds it
    (``text_cfg``'s ``proj_bias``: a ``Linear``; ``proj_type: none``: no projection, the tower's width)."""
    projection = model.text_projection
    if projection is None:
        return int(model.transformer.width)
    return int(projection.out_features if isinstance(projection, nn.Linear) else projection.shape[-1])


def _open_clip_teacher(path: str, name: str, state: dict, tokenizer_dir: Optional[str]) -> Teacher:
    bias = {"init_logit_bias": 0.0} if "logit_bias" in state else {}  # its value comes from the weights
    model = create_model(name, **bias)
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        raise ValueError(
            f"{KEY}: the weights of {path} do not fit open_clip model {name!r}: "
            f"{str(err).splitlines()[0]} (name the right one with model.init_args.distill.teacher_model)"
        ) from None
    return Teacher(model, build_tokenizer(name, tokenizer_dir), tokenizer_signature(name, tokenizer_dir), path,
                   open_clip_image_settings(model))


def _lightning_teacher(source: ModelFile, model_name: Optional[str], tokenizer_dir: Optional[str]) -> Teacher:
    if source.checkpoint.get(LORA_BASE):  # adapters only: the open_clip weights would not fit, naming the wrong cause
        raise ValueError(f"{KEY}: {source.path} is a LoRA checkpoint (adapters over a base model), which a teacher "
                         f"does not read: merge it into a folder with tools/export.py --ckpt {source.path} --format "
                         "open_clip_hf --output DIR, and pass DIR")
    hparams = source.init_args()  # renamed keys under their new names
    name = model_name or hparams.get("model_name")
    if not name:
        raise ValueError(f"{KEY}: {source.path} records no model_name: pass model.init_args.distill.teacher_model")
    return _open_clip_teacher(source.path, resolve_model_name(name), source.open_clip_state(),
                              tokenizer_dir or hparams.get("tokenizer"))


def _folder_teacher(path: str, format: str, tokenizer_dir: Optional[str]) -> Teacher:
    if format == TIMM:
        raise ValueError(f"{KEY}: {path} is a {format} export folder, an image model only; a teacher is a CLIP")
    built = _read(lambda: build_folder(path, tokenizer_dir), path)
    image = (built.image_size, built.image_mean, built.image_std)
    if format == HF:
        signature = ("transformers", os.path.abspath(path))
        return Teacher(built.model, built.tokenizer, signature, path, image, hf=True, weights=built.weights)
    signature = _text_signature(built.config.get("text_cfg", {}), built.tokenizer_dir)
    return Teacher(built.model, built.tokenizer, signature, path, image, weights=built.weights)


def load_teacher(path: str, model_name: Optional[str] = None, tokenizer_dir: Optional[str] = None,
                 ema: bool = False) -> Teacher:
    """Build the frozen teacher a file or folder holds (see the module docstring for the forms).

    Args:
        path: Lightning checkpoint, open_clip state dict, ``open_clip_hf`` or transformers folder.
        model_name: the open_clip model name or JSON config of a state-dict file (and an override
            of what an mmssl checkpoint records).
        tokenizer_dir: local folder of the teacher's Hugging Face tokenizer, when its config names one
            (of an ``open_clip_hf`` folder, default: the folder itself).
        ema: a Lightning checkpoint's EMA of the weights (``mmssl.callbacks.EMA``) instead of its raw
            weights, the default; refused for a file or folder without one.

    Returns:
        The teacher on the CPU, frozen, in eval mode.

    Raises:
        FileNotFoundError: no such file or folder, or a tokenizer not on disk (the message holds
            the command that fetches it).
        UnsafeCheckpointError: the weights file pickles code (nothing of it ran).
        ValueError: an unreadable file, a non-CLIP checkpoint, weights that do not fit the model,
            ``ema`` for a teacher without averaged weights.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"{KEY}: no teacher file or folder at {path!r}")
    source = _read(lambda: read_model_file(path, ema, kinds=("CLIP",), where=KEY), path)
    if source.format in (OPEN_CLIP_HF, HF, TIMM):
        return _folder_teacher(path, source.format, tokenizer_dir)
    if source.format == LIGHTNING:
        return _lightning_teacher(source, model_name, tokenizer_dir)
    if model_name is None:
        raise ValueError(f"{KEY}: {path} is a state dict: name its open_clip model or JSON config with "
                         "model.init_args.distill.teacher_model")
    return _open_clip_teacher(path, resolve_model_name(model_name), source.state_dict, tokenizer_dir)


def _read(read: Callable[[], Any], path: str) -> Any:
    """``read()`` of a teacher's file; an unreadable one named as the teacher."""
    try:
        return read()
    except (FileNotFoundError, UnsafeCheckpointError, ImportError) as err:
        raise type(err)(f"{KEY}: {err}") from None
    except (ValueError, KeyError) as err:
        message = str(err.args[0]) if err.args else str(err)
        raise type(err)(message if message.startswith(KEY) else f"{KEY}: {message}") from None
    except Exception as err:  # torch's zip reader raises RuntimeError on a truncated or foreign file
        raise ValueError(f"{KEY}: {path} is not a readable checkpoint ({type(err).__name__}: {err})") from None

