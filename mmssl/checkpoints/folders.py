"""Export folders, read and built: which format a folder is (:func:`folder_format`) and one builder
per format (:func:`build_folder`), which the evaluation encoders (:mod:`mmssl.evaluation.encoders`)
and the distillation teacher (:mod:`mmssl.models.teacher`) both wrap, so that the two cannot drift.

* ``open_clip_hf``: ``open_clip_config.json`` + ``open_clip_model.safetensors`` (``tools/export.py
  --format open_clip_hf``, open_clip's ``push_to_hf_hub``);
* ``hf``: a transformers ``CLIPModel`` folder, ``config.json`` + ``model.safetensors`` with its
  tokenizer files and ``preprocessor_config.json`` (``--format hf``);
* ``timm``: a timm hub folder, ``config.json`` naming the ``architecture`` (``--format timm``).

Each model is built from its folder's config and loaded strictly with the weights read by
:func:`mmssl.checkpoints.read_state_dict` (weights only), never by the library's own loader, and
nothing downloads. Errors name the folder; callers add their option. :mod:`.model_file` imports this
module, so it sits on that floor: it builds other libraries' models, none of mmssl's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

from torch import Tensor, nn

from mmssl.checkpoints.read import is_dcp_folder, read_state_dict
from mmssl.errors import CheckpointError
from mmssl.upstream import transformers_config_origin

OPEN_CLIP_HF, HF, TIMM = "open_clip_hf", "hf", "timm"
OPEN_CLIP_HF_CONFIG = "open_clip_config.json"
WEIGHTS = {OPEN_CLIP_HF: ("open_clip_model.safetensors", "open_clip_pytorch_model.bin"),
           HF: ("model.safetensors", "pytorch_model.bin"), TIMM: ("model.safetensors", "pytorch_model.bin")}
# A fast tokenizer's tokenizer.json, a BPE vocabulary (vocab.json + merges.txt), a SentencePiece model.
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "spiece.model", "tokenizer.model", "sentencepiece.bpe.model")
RANDOM_INIT_NOTICE = "No pretrained weights loaded for model"

__all__ = ["FolderModel", "HF", "OPEN_CLIP_HF", "TIMM", "build_folder", "build_hf_folder", "build_open_clip_folder",
           "build_timm_folder", "folder_format", "hf_projected", "open_clip_image_settings", "timm_image_settings",
           "weights_path"]

ImageSettings = tuple[int, tuple[float, ...], tuple[float, ...]]


@dataclass
class FolderModel:
    """An export folder's model, built (:func:`build_folder`).

    Attributes:
        path: the folder.
        format: ``open_clip_hf``, ``hf`` or ``timm``.
        model: open_clip's model, a transformers ``CLIPModel`` or a timm model without its head
            (``num_classes=0``); weights loaded strictly, in eval mode, on the CPU.
        tokenizer: captions -> (B, L) token ids padded to the context; ``None`` for a timm folder.
        image_size, image_mean, image_std: the model's input size and normalisation.
        weights: the weights file read.
        config: the folder's model config (open_clip's ``model_cfg``, transformers' or timm's ``config.json``).
        tokenizer_dir: the folder a Hugging Face tokenizer was read from; ``None`` for open_clip's BPE.
    """

    path: str
    format: str
    model: nn.Module
    tokenizer: Optional[Callable[[Sequence[str]], Tensor]]
    image_size: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    weights: str
    config: dict = field(default_factory=dict)
    tokenizer_dir: Optional[str] = None


def read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def folder_format(path: str) -> Optional[str]:
    """Which export folder ``path`` is: ``"open_clip_hf"``, ``"timm"``, ``"hf"``, or ``None`` (a file
    or a sharded checkpoint folder).

    Raises:
        ValueError: a folder that is none of them (its files named).
    """
    if not os.path.isdir(path) or is_dcp_folder(path):
        return None
    if os.path.isfile(os.path.join(path, OPEN_CLIP_HF_CONFIG)):
        return OPEN_CLIP_HF
    config = os.path.join(path, "config.json")
    if os.path.isfile(config):
        data = read_json(config)
        if "architecture" in data:
            return TIMM
        if data.get("model_type") == "clip" or "CLIPModel" in (data.get("architectures") or []):
            return HF
    raise CheckpointError(f"{path}: not an export folder (open_clip_config.json, a timm config.json or a transformers "
                          f"CLIPModel config.json); it holds {sorted(os.listdir(path))[:8]}")


def weights_path(folder: str, format: str) -> str:
    """The weights file of an export folder of ``format``, the first of :data:`WEIGHTS` present.

    Raises:
        FileNotFoundError: none is.
    """
    names = WEIGHTS[format]
    path = next((os.path.join(folder, n) for n in names if os.path.isfile(os.path.join(folder, n))), None)
    if path is None:
        raise FileNotFoundError(f"{folder}: no weights file ({' or '.join(names)})")
    return path


def _load_strict(model: nn.Module, state: dict[str, Tensor], folder: str, config: str) -> None:
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        raise CheckpointError(f"the weights of {folder} do not fit its {config}: {str(err).strip()}") from None


def open_clip_image_settings(model: nn.Module) -> ImageSettings:
    """An open_clip model's input size, mean and std (what its ``preprocess_cfg`` set on ``model.visual``)."""
    size = model.visual.image_size
    size = size[0] if isinstance(size, (tuple, list)) else size
    return int(size), tuple(model.visual.image_mean), tuple(model.visual.image_std)


def timm_image_settings(model: nn.Module) -> ImageSettings:
    """A timm model's input size (its patch embedding's, else its data config's), mean and std."""
    import timm

    config = timm.data.resolve_data_config(model=model)
    size = getattr(getattr(model, "patch_embed", None), "img_size", None) or config["input_size"][1:]
    return int(size[0]), tuple(config["mean"]), tuple(config["std"])


def _require_tokenizer(folder: str, origin: str) -> None:
    if not any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"the folder {folder!r} has no tokenizer files ({', '.join(TOKENIZER_FILES)}), and mmssl never "
            f"downloads: fetch them once (huggingface-cli download "
            f"{origin or 'REPO'} --local-dir {folder})")


@contextlib.contextmanager
def without_random_init_notice() -> Iterator[None]:
    """Drop open_clip's "No pretrained weights loaded ... initialized randomly" (logged on the root
    logger) during a build whose weights are loaded right after; every other message stays."""
    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(RANDOM_INIT_NOTICE)

    root = logging.getLogger()
    root.addFilter(keep)
    try:
        yield
    finally:
        root.removeFilter(keep)


def _open_clip_tokenizer(folder: str, text_cfg: dict, tokenizer_dir: Optional[str]) -> tuple[Callable, Optional[str]]:
    """The tokenizer ``open_clip.get_tokenizer("local-dir:FOLDER")`` builds (open_clip's BPE, or the
    Hugging Face tokenizer the config names, read from the folder itself as open_clip's hub folders
    carry it), except that ``tokenizer_dir`` names another folder to read it from: mmssl's own
    export writes no tokenizer files, and the teacher's ``distill.teacher_tokenizer`` points at them."""
    from open_clip.tokenizer import HFTokenizer, SimpleTokenizer

    hf_name = text_cfg.get("hf_tokenizer_name")
    context, kwargs = int(text_cfg.get("context_length", 77)), dict(text_cfg.get("tokenizer_kwargs", {}))
    if not hf_name:
        if tokenizer_dir is not None:
            raise CheckpointError(f"{folder}: its open_clip config tokenizes with open_clip's built-in BPE tokenizer; "
                                  f"a tokenizer folder ({tokenizer_dir}) does not apply: leave it unset")
        return SimpleTokenizer(context_length=context, **kwargs), None
    source = tokenizer_dir or folder
    _require_tokenizer(source, hf_name)
    mode = text_cfg.get("tokenizer_mode")
    return HFTokenizer(source, context_length=context, **({"tokenizer_mode": mode} if mode else {}), **kwargs), source


def build_open_clip_folder(folder: str, tokenizer_dir: Optional[str] = None) -> FolderModel:
    """An open_clip hub folder: the model ``open_clip.create_model("local-dir:FOLDER")`` builds from
    ``open_clip_config.json`` (its ``model_cfg`` and ``preprocess_cfg``), the weights strict.

    ``local-dir:`` reads the config where it is and merges its ``preprocess_cfg`` as open_clip does.
    The teacher used to register the ``model_cfg`` under a temporary name (``open_clip.add_model_config``
    of a copy in a temporary file) and build that: the same model, but one more name left in
    open_clip's global table per folder read. The tokenizer is ``local-dir:``'s too (from the folder
    itself), except where ``tokenizer_dir`` names another folder, as the teacher's tests require
    (mmssl's export writes no tokenizer files): :func:`_open_clip_tokenizer`.

    Args:
        folder: the folder.
        tokenizer_dir: a folder holding the Hugging Face tokenizer the config names (default: the
            folder itself); refused for a config with open_clip's BPE.

    Raises:
        FileNotFoundError: no weights file, or no tokenizer files (with the command that fetches them).
        ValueError: a config without ``model_cfg``; weights that do not fit it.
    """
    import open_clip

    config = read_json(os.path.join(folder, OPEN_CLIP_HF_CONFIG))
    if "model_cfg" not in config:
        raise CheckpointError(f"{os.path.join(folder, OPEN_CLIP_HF_CONFIG)} has no 'model_cfg'")
    weights = weights_path(folder, OPEN_CLIP_HF)
    state = read_state_dict(weights)
    tokenizer, source = _open_clip_tokenizer(folder, config["model_cfg"].get("text_cfg", {}), tokenizer_dir)
    bias = {"init_logit_bias": 0.0} if "logit_bias" in state else {}  # its value comes from the weights
    with without_random_init_notice():
        model = open_clip.create_model(f"local-dir:{folder}", load_weights=False, output_dict=True, **bias)
    _load_strict(model, state, folder, OPEN_CLIP_HF_CONFIG)
    return FolderModel(folder, OPEN_CLIP_HF, model.eval(), tokenizer, *open_clip_image_settings(model), weights,
                       config["model_cfg"], source)


def hf_projected(out) -> Tensor:
    """The projected features of a transformers ``CLIPModel.get_image_features`` / ``get_text_features``:
    a tensor before transformers 5, the ``pooler_output`` of an output object from 5 on."""
    return out if isinstance(out, Tensor) else out.pooler_output


def build_hf_folder(folder: str) -> FolderModel:
    """A transformers ``CLIPModel`` folder, with its tokenizer (open_clip's ``HFTokenizer`` over the
    folder's files, padded to the text context) and ``preprocessor_config.json``'s mean and std
    (OpenAI's where it has none). The image size is the model's own (its position embeddings'), which
    the processor's ``crop_size`` equals in every CLIP folder.

    Raises:
        ImportError: transformers is not installed.
        FileNotFoundError: no weights file, or no tokenizer files (with the command that fetches them).
        ValueError: weights that do not fit ``config.json``.
    """
    try:
        from transformers import CLIPConfig, CLIPModel
    except ImportError as err:
        raise ImportError(f"{folder} is a transformers folder: pip install -e '.[hf]'") from err
    from open_clip.tokenizer import HFTokenizer

    from mmssl.data.transforms import OPENAI_MEAN, OPENAI_STD

    config = CLIPConfig.from_pretrained(folder, local_files_only=True)
    weights = weights_path(folder, HF)
    model = CLIPModel(config)
    _load_strict(model, read_state_dict(weights), folder, "config.json")
    _require_tokenizer(folder, transformers_config_origin(config))
    tokenizer = HFTokenizer(folder, context_length=int(config.text_config.max_position_embeddings))
    pre_path = os.path.join(folder, "preprocessor_config.json")
    pre = read_json(pre_path) if os.path.isfile(pre_path) else {}
    return FolderModel(folder, HF, model.eval(), tokenizer, int(config.vision_config.image_size),
                       tuple(pre.get("image_mean", OPENAI_MEAN)), tuple(pre.get("image_std", OPENAI_STD)), weights,
                       config.to_dict(), folder)


def build_timm_folder(folder: str) -> FolderModel:
    """A timm hub folder: ``config.json``'s architecture and ``model_args``, the head dropped (the
    weights' ``head.*`` too: a fine-tuned classifier's; probes read the pre-logits), the rest strict.

    Raises:
        FileNotFoundError: no weights file. ValueError: weights that do not fit ``config.json``.
    """
    import timm

    config = read_json(os.path.join(folder, "config.json"))
    weights = weights_path(folder, TIMM)
    model = timm.create_model(config["architecture"], pretrained=False, pretrained_cfg=config.get("pretrained_cfg"),
                              **{**config.get("model_args", {}), "num_classes": 0})
    state = {k: v for k, v in read_state_dict(weights).items() if not k.startswith("head.")}
    _load_strict(model, state, folder, "config.json")
    return FolderModel(folder, TIMM, model.eval(), None, *timm_image_settings(model), weights, config)


def build_folder(path: str, tokenizer_dir: Optional[str] = None, format: Optional[str] = None) -> FolderModel:
    """The model of an export folder, by its format (:func:`folder_format`, unless ``format`` says it).

    Args:
        path: the folder.
        tokenizer_dir: an ``open_clip_hf`` folder's Hugging Face tokenizer folder (see
            :func:`build_open_clip_folder`); ignored for the others.
        format: the folder's format, when already known.

    Raises:
        ValueError: ``path`` is no export folder; see each format's builder.
    """
    format = format or folder_format(path)
    if format is None:
        raise CheckpointError(f"{path}: not an export folder")
    if format == OPEN_CLIP_HF:
        return build_open_clip_folder(path, tokenizer_dir)
    return {HF: build_hf_folder, TIMM: build_timm_folder}[format](path)

