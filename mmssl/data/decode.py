"""Late decoding of raw webdataset samples (img2dataset layout) into model inputs.

Runs in the loader workers, after the shuffle buffer (which holds raw bytes, as webdataset's
docs advise: decoded tensors would cost 10-100x the memory). Every way a sample can be unusable
raises :class:`BadSample` with a short reason, so the stream skips it, warns once naming shard and
key, and counts it.
"""

from __future__ import annotations

import io
import math
import random
import re
import warnings
from typing import Any, Callable, Optional, Sequence, Union

from PIL import Image
from torch import Tensor
from torch.utils.data import default_collate

# ``image.info`` key of a reduced-size JPEG decode: (stored width, stored height, reduction).
REDUCED_FROM = "mmssl_reduced_from"
# Largest image (width x height, from its header) decoded: PIL's own decompression-bomb warning
# threshold (the default ``Image.MAX_IMAGE_PIXELS``, 1024**3 // 4 // 3, a 256 MiB RGB decode; a
# 9459 x 9459 image). Photos and web-scale sets lie far below it (img2dataset resizes to <= 1024
# px; ImageNet's largest images are under 20 Mpx); above it, one decode costs each loader worker
# hundreds of MB for an image the model sees at 224 px. PIL itself refuses twice this.
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485
INT64_MAX = 2**63 - 1
_INTEGER = re.compile(r"\s*(-?[0-9]+)\s*")


class BadSample(Exception):
    """A sample that cannot be used; the message says why."""


def parse_label(raw: Union[bytes, str], num_classes: Optional[int] = None, name: str = "label") -> int:
    """An integer class label (a ``.cls`` member), checked against its bounds.

    Args:
        raw: the label's text: ASCII digits, optionally ``-`` and surrounding white space.
        num_classes: when known, labels must be below it (``None``: no upper bound but int64's).
        name: what the label is called in the error (e.g. ``"'cls'"``).

    Returns:
        The label, in ``[0, num_classes)`` (or ``[0, 2**63)``).

    Raises:
        ValueError: not an integer, negative, beyond int64 (torch's label type) or not below
            ``num_classes``; the message starts with ``name`` and quotes the value.
    """
    try:
        text = raw.decode("ascii") if isinstance(raw, (bytes, bytearray)) else str(raw)
    except UnicodeDecodeError:
        text = None
    match = _INTEGER.fullmatch(text) if text is not None else None
    if match is None:
        raise ValueError(f"{name} is not an integer: {raw[:20]!r}")
    label = int(match.group(1))
    if label < 0:
        raise ValueError(f"{name} is negative: {label}")
    if label > INT64_MAX:
        raise ValueError(f"{name} overflows int64: {match.group(1)[:40]}")
    if num_classes is not None and label >= num_classes:
        raise ValueError(f"{name} {label} is out of range for num_classes={num_classes}")
    return label


def open_image(data: bytes, min_size: Optional[int] = None,
               max_pixels: Optional[int] = DEFAULT_MAX_IMAGE_PIXELS) -> Image.Image:
    """Decode image bytes to an RGB PIL image, reduced-size for large JPEGs.

    Args:
        data: encoded image (JPEG, PNG, WebP, ...).
        min_size: smallest side the transform needs; a JPEG whose both sides exceed twice this is
            decoded at 1/2, 1/4 or 1/8 scale by libjpeg's DCT scaling (Pillow's ``Image.draft``),
            which picks the largest reduction that keeps both sides >= ``min_size``. Decoding a
            1024-pixel JPEG for a 224-pixel model this way is several times faster, but gives other
            pixels than a full decode and resize: a training option only. Evaluation passes
            ``None``, so that its figures are those of every evaluator (open_clip's preprocess,
            CLIP_benchmark), which decode in full.
        max_pixels: largest width x height decoded, read from the header (``Image.open`` reads
            only the header) before any pixel is; ``None``: no limit of mmssl's (PIL's own
            ``Image.MAX_IMAGE_PIXELS`` x 2 still applies).

    Returns:
        The fully decoded RGB image (``load`` is forced here, so truncated files fail here). After
        a reduced decode, ``image.info[REDUCED_FROM]`` holds ``(width, height, scale)``: the stored
        image's size and the reduction (2, 4 or 8), so that
        :class:`~mmssl.data.transforms.RandomResizedCropFlip` can draw its crop on the stored
        image's pixel grid, as it would without the reduction.

    Raises:
        BadSample: the header's size is above ``max_pixels`` (nothing was decoded).
    """
    with warnings.catch_warnings():
        if max_pixels is not None:  # the limit below decides, and names the sample; PIL's warning would not
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        image = Image.open(io.BytesIO(data))
    width, height = image.size
    if max_pixels is not None and width * height > max_pixels:
        raise BadSample(f"{width}x{height} image ({width * height} pixels) is above max_image_pixels={max_pixels}: "
                        "not decoded")
    reduced_from = None
    if min_size and image.format == "JPEG":
        drafted = image.draft("RGB", (min_size, min_size))
        if drafted is not None and drafted[1][2] < width:  # Pillow's box: the full extent, in reduced pixels
            reduced_from = (width, height, width / drafted[1][2])
    image.load()
    if image.mode != "RGB":
        image = image.convert("RGB")
    if reduced_from is not None:
        image.info[REDUCED_FROM] = reduced_from
    return image


def draft_size(image_size: int, min_crop_scale: float = 1.0) -> int:
    """Smallest stored side that still gives a full-resolution crop.

    A RandomResizedCrop of area fraction ``s`` spans about ``sqrt(s)`` of the side, so the image
    must keep ``image_size / sqrt(s)`` pixels for the smallest crop not to be upsampled.

    Args:
        image_size: model input side.
        min_crop_scale: smallest crop area fraction of the training crop.

    Returns:
        The ``min_size`` to pass to :func:`open_image`.
    """
    return math.ceil(image_size / math.sqrt(max(min_crop_scale, 1e-3)))


class SampleDecoder:
    """Raw sample (``{"__key__", "__url__", ext: bytes}``) -> ``{"image", "text"?, "label"?}``.

    A class rather than a closure so it pickles into loader workers.

    A random ``transform`` takes the sample's RNG as ``transform(image, rng)`` when the stream
    passes one (training: drawn from (seed, epoch, sample), so a resumed run crops alike).

    Captions are checked here and tokenised per batch in :meth:`collate` (open_clip's tokenizer
    takes a list: one call for 32 captions costs 96 us a caption against 230 us one at a time).

    Args:
        transform: PIL image -> ``(3, H, W)`` tensor.
        tokenizer: list of captions -> (N, L) token ids (open_clip's tokenizer); ``None`` ignores
            captions (MAE).
        image_keys: extensions holding the image, first present wins.
        text_key: extension holding the caption.
        label_key: extension holding an integer class (optional in the sample), read by
            :func:`parse_label`.
        min_size: reduced-size JPEG decode target, see :func:`open_image`; ``None`` (always for
            held-out data) decodes in full.
        batch_transform: applied to the stacked ``(B, 3, H, W)`` images in :meth:`collate`
            (e.g. :class:`~mmssl.data.transforms.BatchNormalize` after a uint8 ``transform``).
        num_classes: labels must lie in ``[0, num_classes)``; ``None``: any int64 >= 0.
        max_pixels: largest image decoded (width x height from the header), see :func:`open_image`.
        teacher_tokenizer: a distillation teacher's own tokenizer, when its token ids differ from
            the student's: captions are tokenised twice, the teacher's ids as ``teacher_tokens``.
        teacher_embeddings: stored teacher embeddings joined by key
            (:class:`mmssl.data.teacher_embeddings.TeacherEmbeddings`), as ``teacher_image_features``
            and ``teacher_text_features``; a sample without them is bad.
        captions: makes each caption from the sample's class label instead of reading
            ``text_key`` (FLYP; :class:`mmssl.data.captions.ClassCaptions`), the template drawn
            from the sample's RNG after its crop.
    """

    def __init__(
        self,
        transform: Callable,
        tokenizer: Optional[Callable],
        image_keys: Sequence[str] = ("jpg", "jpeg", "png", "webp"),
        text_key: str = "txt",
        label_key: str = "cls",
        min_size: Optional[int] = None,
        batch_transform: Optional[Callable] = None,
        num_classes: Optional[int] = None,
        max_pixels: Optional[int] = DEFAULT_MAX_IMAGE_PIXELS,
        teacher_tokenizer: Optional[Callable] = None,
        teacher_embeddings: Optional[Any] = None,
        captions: Optional[Any] = None,
    ) -> None:
        self.captions = captions
        self.transform, self.tokenizer, self.batch_transform = transform, tokenizer, batch_transform
        self.image_keys, self.text_key, self.label_key = tuple(image_keys), text_key, label_key
        self.min_size, self.num_classes, self.max_pixels = min_size, num_classes, max_pixels
        self.teacher_tokenizer, self.teacher_embeddings = teacher_tokenizer, teacher_embeddings

    def output_keys(self, raw: dict[str, Any]) -> set[str]:
        """The keys :meth:`__call__` returns for ``raw`` if it decodes (found without decoding)."""
        return {"image"} | ({"text"} if self.tokenizer is not None else set()) | (
            {"label"} if self.label_key in raw else set()) | (
            {"teacher_image_features", "teacher_text_features"} if self.teacher_embeddings is not None else set())

    def __call__(self, raw: dict[str, Any], rng: Optional[random.Random] = None) -> dict[str, Any]:
        image_key = next((k for k in self.image_keys if k in raw), None)
        if image_key is None:
            raise BadSample(f"no image (looked for {', '.join(self.image_keys)})")
        out: dict[str, Any] = {}
        if self.tokenizer is not None and self.captions is None:
            out["text"] = self._caption(raw)  # tokenised with its batch, in collate
        if self.label_key in raw:
            try:
                out["label"] = parse_label(raw[self.label_key], self.num_classes, repr(self.label_key))
            except ValueError as exn:
                raise BadSample(str(exn)) from None
        if self.teacher_embeddings is not None:  # before the image: a missing row costs no decode
            out["teacher_image_features"], out["teacher_text_features"] = self.teacher_embeddings.lookup(raw)
        out["image"] = self._image(raw, image_key, rng)
        if self.tokenizer is not None and self.captions is not None:  # drawn after the crop's draws
            out["text"] = self.captions.caption(out.get("label"), rng, raw.get("__key__"))
        return out

    def _image(self, raw: dict[str, Any], image_key: str, rng: Optional[random.Random]) -> Any:
        try:
            image = open_image(raw[image_key], self.min_size, self.max_pixels)
        except BadSample as exn:
            raise BadSample(f"{image_key}: {exn}") from None
        except Exception as exn:  # PIL raises OSError, SyntaxError, ValueError... on bad data
            raise BadSample(f"unreadable {image_key} ({type(exn).__name__}: {exn})") from None
        return self.transform(image) if rng is None else self.transform(image, rng)

    def collate(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        """Stack decoded samples, which all carry the same keys, into a batch, tokenising captions.

        The stream skips a sample that lacks a key its stream carries
        (:func:`~mmssl.data.pipeline.worker_batches`), so no key is dropped for a whole batch.

        Args:
            samples: outputs of ``__call__``.

        Returns:
            ``{"image": (B, 3, H, W), "text": (B, L)?, "label": (B,)?}``, plus with a teacher
            ``teacher_tokens`` (B, L')? and ``teacher_image_features``, ``teacher_text_features`` (B, D)?.

        Raises:
            ValueError: the samples do not all carry the same keys.
        """
        keys = set(samples[0])
        odd = next((s for s in samples if set(s) != keys), None)
        if odd is not None:
            raise ValueError(f"a batch mixes samples with keys {sorted(keys)} and {sorted(odd)}")
        captions = [s["text"] for s in samples] if "text" in keys else None
        batch = default_collate([{k: s[k] for k in keys if k != "text"} for s in samples])
        if captions is not None:
            batch["text"] = self.tokenizer(captions)
            if self.teacher_tokenizer is not None:
                batch["teacher_tokens"] = self.teacher_tokenizer(captions)
        if self.batch_transform is not None:
            batch["image"] = self.batch_transform(batch["image"])
        return batch

    def _caption(self, raw: dict[str, Any]) -> str:
        if self.text_key not in raw:
            raise BadSample(f"no caption {self.text_key!r}")
        try:
            text = raw[self.text_key].decode("utf-8").strip()
        except UnicodeDecodeError as exn:
            raise BadSample(f"caption {self.text_key!r} is not UTF-8 ({exn.reason} at byte {exn.start})") from None
        if not text:
            raise BadSample(f"empty caption {self.text_key!r}")
        return text


def trim_text_padding(tokens: Tensor, pad_id: int = 0) -> Tensor:
    """Drop the trailing columns of a token batch that are padding in every row.

    Args:
        tokens: (B, L) token ids, padded on the right with ``pad_id`` (open_clip pads with 0).
        pad_id: the padding id.

    Returns:
        (B, L') with L' the length of the longest sequence (at least 1): a view, no copy.
    """
    used = (tokens != pad_id).any(dim=0).nonzero()
    return tokens[:, : int(used[-1]) + 1 if len(used) else 1]
