"""Captions from a CoCa model, and how often they name an image's class.

Pure functions over a module with ``generate(images, generation_type, seq_len, **params)``,
``generation_ids()`` and ``tokenizer`` (:class:`mmssl.models.coca.CoCa`), used by the
``CaptionNaming`` callback and ``tools/caption.py``.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import Tensor, nn
from torchmetrics.aggregation import SumMetric

from mmssl.evaluation.features import frozen_eval


def decode_captions(tokenizer: Any, ids: Tensor, sot_token_id: int, eos_token_id: int, pad_token_id: int) -> list[str]:
    """(B, T) generated ids -> B strings: the tokens after the start token, up to the end token.

    Args:
        tokenizer: open_clip's ``SimpleTokenizer`` (``decode``) or ``HFTokenizer`` (``.tokenizer.decode``).
        ids: generated token ids.
        sot_token_id: start-of-text id, dropped.
        eos_token_id: end-of-text id; it and what follows are dropped.
        pad_token_id: padding id, dropped.
    """
    hf = getattr(tokenizer, "tokenizer", None)
    texts = []
    for row in ids.tolist():
        row = row[1:] if row and row[0] == sot_token_id else row
        row = row[: row.index(eos_token_id)] if eos_token_id in row else row
        row = [t for t in row if t != pad_token_id]
        texts.append((hf.decode(row, skip_special_tokens=True) if hf is not None else tokenizer.decode(row)).strip())
    return texts


@torch.no_grad()
def generate_captions(model: nn.Module, images: Tensor, generation_type: str = "beam_search",
                      seq_len: Optional[int] = None, **params: Any) -> list[str]:
    """One caption per image.

    Sampling draws from a forked RNG (``frozen_eval``), so a caption pass inside training leaves
    the run's random stream where it was.

    Args:
        model: a CoCa module (left in its original mode).
        images: (B, 3, H, W) preprocessed images on the model's device.
        generation_type: ``beam_search``, ``top_p`` or ``top_k``.
        seq_len: longest caption in tokens, start and end included; ``None``: the model's text context.
        **params: the type's parameters (``num_beams``, ``top_p``, ``top_k``, ``temperature``, ...).

    Returns:
        B captions.
    """
    with frozen_eval(model):
        ids = model.generate(images, generation_type=generation_type, seq_len=seq_len, **params)
    return decode_captions(model.tokenizer, ids, **model.generation_ids())


def names_class(caption: str, classname: str) -> bool:
    """Whether ``caption`` names ``classname``: the class name's words appear in it as a phrase
    (whole words, case and punctuation ignored). On the demo set, whose class names are
    "colour shape", this is a caption naming both the colour and the shape correctly."""
    words = re.findall(r"[a-z0-9]+", classname.lower())
    return bool(words) and re.search(r"\b" + r"\W+".join(map(re.escape, words)) + r"\b", caption.lower()) is not None


@torch.no_grad()
def caption_naming_evaluate(
    model: nn.Module,
    batches: Iterable[dict[str, Tensor]],
    classnames: Sequence[str],
    device: torch.device,
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    **generation: Any,
) -> dict[str, Tensor]:
    """Share of images whose generated caption names their class (:func:`names_class`).

    Sums reduce over ranks when a process group is up (each rank passes its own batches; a rank
    with none still takes part), so every rank returns the total.

    Args:
        model: CoCa module.
        batches: ``{"image", "label"}`` batches of this rank.
        classnames: class names in label order.
        device: the model's device.
        context: precision context around the forwards.
        **generation: :func:`generate_captions`'s arguments.

    Returns:
        ``{"names_class": share, "num_samples": n}``.
    """
    hits, count = SumMetric().to(device), SumMetric().to(device)
    hits.update(torch.zeros((), device=device))
    count.update(torch.zeros((), device=device))
    for batch in batches:
        if len(batch["label"]) == 0:
            continue
        with context():
            captions = generate_captions(model, batch["image"].to(device), **generation)
        named = [names_class(c, classnames[int(y)]) if 0 <= int(y) < len(classnames) else False
                 for c, y in zip(captions, batch["label"].tolist())]
        hits.update(torch.tensor(float(sum(named)), device=device))
        count.update(torch.tensor(float(len(named)), device=device))
    n = count.compute()
    return {"names_class": hits.compute() / n.clamp(min=1), "num_samples": n}
