"""open_clip model configs as mmssl reads them: names or JSON files, models built without
open_clip's random-init notice, tokenizers that never download, the text towers whose padding is
inert, and open_clip's weight-decay rule."""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import open_clip
import torch

from mmssl.checkpoints import read_checkpoint
from mmssl.checkpoints.folders import without_random_init_notice
from mmssl.checkpoints.model_file import lightning_open_clip_state
from mmssl.optim import NDIM_LT_2


def create_model(name: str, pretrained: Optional[str] = None, **kwargs: Any) -> torch.nn.Module:
    """``open_clip.create_model(name, pretrained, **kwargs)``, without its random-init notice.

    open_clip warns "No pretrained weights loaded for model ... Model initialized randomly" on
    the root logger whenever ``pretrained`` is ``None``. In mmssl that is either a fresh run (random
    initialisation is the point) or a tool or export that loads a checkpoint's weights right
    after, so the notice would only mislead. That one message is dropped, during this call only;
    every other open_clip message (and the notice when a ``pretrained`` file is given) stays.

    Args:
        name: open_clip model name (see :func:`resolve_model_name`).
        pretrained: local open_clip checkpoint file, an mmssl CLIP or CoCa Lightning checkpoint (its
            open_clip model's weights: :func:`mmssl.checkpoints.model_file.lightning_open_clip_state`),
            or ``None`` for random weights.
        **kwargs: passed to ``open_clip.create_model``.

    Returns:
        The open_clip model.
    """
    if pretrained is not None:
        mmssl_clip = lightning_open_clip_state(pretrained)
        if mmssl_clip is None:
            return open_clip.create_model(name, pretrained=pretrained, **kwargs)
        model = create_model(name, None, **kwargs)
        model.load_state_dict(mmssl_clip)  # strict: another model config fails naming the keys
        return model
    with without_random_init_notice():  # open_clip's factory logs through logging.warning (the root logger)
        return open_clip.create_model(name, pretrained=None, **kwargs)


def resolve_model_name(model_name: str) -> str:
    """Register a JSON model config with open_clip if given a path; return the open_clip name.

    Args:
        model_name: an open_clip model name (``ViT-B-32``) or a path to a ``.json`` config.

    Returns:
        The name open_clip knows the config by (the file's stem for a JSON path).
    """
    if model_name.endswith(".json"):
        # Recipes name model configs relative to the repository root (configs/models/...); a run
        # started elsewhere (or `mmssl validate` on a run folder's config.yaml, or a tool of a wheel
        # install reading a clone's checkpoint) still finds them.
        tried = [model_name]
        if not os.path.isabs(model_name):
            package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            # The clone's root, then the installed package, which ships configs/ as mmssl/configs.
            tried += [os.path.join(os.path.dirname(package), model_name), os.path.join(package, model_name)]
        found = next((p for p in tried if os.path.isfile(p)), None)
        if found is None:
            raise FileNotFoundError(f"model.model_name: no model config file at {' or '.join(map(repr, tried))}")
        open_clip.add_model_config(found)
        return os.path.splitext(os.path.basename(model_name))[0]
    if model_name not in open_clip.list_models():
        raise ValueError(
            f"model.model_name: {model_name!r} is neither an open_clip model "
            "(see open_clip.list_models()) nor a path to a .json model config"
        )
    return model_name


def text_padding_is_inert(model: torch.nn.Module) -> bool:
    """Whether trailing padding cannot change ``model.encode_text``'s output.

    True for open_clip's ``CLIP`` text tower as OpenAI built it: a causal mask (no token attends
    to a later one), end-of-text pooling (``argmax``/``eos``: the token of the highest id or the
    EOS id, which precedes the padding), no appended class token. Then the pooled feature depends
    only on tokens up to the EOS, and padding after the longest caption of a batch is dead work.
    """
    return (
        isinstance(model, open_clip.CLIP)
        and getattr(model, "attn_mask", None) is not None
        and getattr(model, "text_pool_type", None) in ("argmax", "eos")
        and getattr(model, "cls_emb", None) is None
    )


OPEN_CLIP_NO_DECAY: tuple[str, ...] = (NDIM_LT_2, "*bn*", "*ln*", "*bias*", "*logit_scale*")


def build_tokenizer(name: str, local_dir: Optional[str] = None) -> Callable:
    """open_clip's tokenizer for model config ``name``, never downloading.

    Configs with open_clip's own BPE vocabulary (shipped in the package) need nothing more; a
    config naming a Hugging Face tokenizer (``text_cfg.hf_tokenizer_name``: the SigLIP configs'
    SentencePiece model) is read from ``local_dir``, a folder holding its files.
    """
    text_cfg = open_clip.get_model_config(name).get("text_cfg", {})
    hf_name = text_cfg.get("hf_tokenizer_name")
    if hf_name is None:
        if local_dir is not None:
            raise ValueError(f"model.tokenizer: {name!r} uses open_clip's built-in BPE tokenizer; leave it unset")
        return open_clip.get_tokenizer(name)
    if local_dir is None or not os.path.isdir(local_dir):
        raise FileNotFoundError(
            f"model.tokenizer: {name!r} tokenizes with the Hugging Face tokenizer {hf_name!r}, and mmssl "
            f"never downloads: fetch it once (huggingface-cli download {hf_name} --local-dir DIR) and pass "
            f"--model.init_args.tokenizer DIR (got {local_dir!r})"
        )
    from open_clip.tokenizer import HFTokenizer

    return HFTokenizer(local_dir, context_length=text_cfg.get("context_length", 77),
                       **text_cfg.get("tokenizer_kwargs", {}))


def checkpoint_has(path: str, key: str) -> bool:
    """Whether an open_clip checkpoint file holds ``key``, read lazily (mmap / safetensors)."""
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            return key in f.keys()
    state = read_checkpoint(path, mmap=True)
    state = state.get("state_dict", state)
    return any(k == key or k.endswith("." + key) for k in state)
