"""Train and eval image transforms, shared by every data module and callback.

open_clip's ``image_transform`` is not reused because MAE needs a different crop scale and a flip;
one parameterised pair serves both recipes: CLIP uses scale (0.9, 1.0) and no flip (open_clip's
default), MAE uses (0.2, 1.0) with flip (MAE pretraining recipe).

Training images are cropped per sample (:class:`RandomResizedCropFlip`: torchvision's crop-sampling rule,
re-implemented, and Pillow's crop + bicubic resize) to a uint8 tensor, and normalised once per batch
(:class:`BatchNormalize`, in the loader's collate step). Same values as torchvision's
``RandomResizedCrop -> ToTensor -> Normalize`` for the same crop (tested), at a fraction of the
CPU time (measured on 28x28 PNGs: 507 -> 124 us per image, most of the saving torchvision's
per-call tensor overhead): loader CPU time is what a 2-core laptop, or a GPU node feeding 8
devices, runs short of.
"""

from __future__ import annotations

import math
import random
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np
import torch
from PIL import Image
from timm.data import auto_augment as timm_auto_augment
from timm.data import create_transform
from torch.utils.data import get_worker_info
from torchvision import transforms as T

from mmssl.data.decode import REDUCED_FROM
from mmssl.upstream import replace_timm_augment_fn

OPENAI_MEAN: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)


def train_sample_transform(image_size: int, scale: tuple[float, float] = (0.9, 1.0), hflip: bool = False) -> Callable:
    """The per-sample half of :func:`train_transform`: PIL image (, rng) -> ``(3, S, S)`` uint8 tensor.

    Stack its outputs and apply :class:`BatchNormalize` once per batch.
    """
    return CropToUint8(RandomResizedCropFlip(image_size, scale, hflip))


class CropToUint8:
    """:class:`RandomResizedCropFlip` then :func:`to_uint8_tensor`, passing the sample's RNG on.

    Args:
        crop: the random crop (and flip).
    """

    def __init__(self, crop: "RandomResizedCropFlip") -> None:
        self.crop = crop

    def __call__(self, image: Image.Image, rng: Optional[random.Random] = None) -> torch.Tensor:
        return to_uint8_tensor(self.crop(image, rng))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.crop!r})"


class LocalCrops:
    """``count`` random-resized crops of one image (DINO's multi-crop ``local`` views, sec. 3.1 and
    ``main_dino.py`` ``DataAugmentationDINO``: scale (0.05, 0.4)), as one ``(count, 3, S, S)`` uint8
    tensor, drawn from the sample's RNG after its training crop: a sample gets the same crops
    whichever worker reads it and after a resume. Normalise with :class:`BatchNormalize`.

    Args:
        count: crops per image (>= 1).
        size: their side in pixels (the model's input: open_clip's ViT has fixed position embeddings).
        scale: area range of each crop, as a fraction of the image.
        hflip: flip each crop left-right with probability 0.5.
    """

    def __init__(self, count: int, size: int, scale: tuple[float, float] = (0.05, 0.4), hflip: bool = False) -> None:
        self.count = count
        self.crop = CropToUint8(RandomResizedCropFlip(size, scale, hflip))

    def __call__(self, image: Image.Image, rng: Optional[random.Random] = None) -> torch.Tensor:
        return torch.stack([self.crop(image, rng) for _ in range(self.count)])  # (count, 3, S, S)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(count={self.count}, {self.crop!r})"


def train_transform(
    image_size: int,
    mean: Sequence[float] = OPENAI_MEAN,
    std: Sequence[float] = OPENAI_STD,
    scale: tuple[float, float] = (0.9, 1.0),
    hflip: bool = False,
) -> Callable:
    """Random-resized crop (+ optional flip), to tensor, normalise, for one image.

    The data module runs the two halves apart (:func:`train_sample_transform` per sample,
    :class:`BatchNormalize` per batch); this is the whole chain for one image.

    Args:
        image_size: output side in pixels.
        mean: per-channel normalisation mean.
        std: per-channel normalisation std.
        scale: area range of the random crop.
        hflip: add a random horizontal flip (off for captions that name left/right).

    Returns:
        A callable from a PIL image to a ``(3, image_size, image_size)`` float tensor.
    """
    return T.Compose([train_sample_transform(image_size, scale, hflip), BatchNormalize(mean, std)])


def eval_transform(
    image_size: int,
    mean: Sequence[float] = OPENAI_MEAN,
    std: Sequence[float] = OPENAI_STD,
) -> Callable:
    """Resize the short side, centre crop, to tensor, normalise (open_clip's eval transform).

    Args:
        image_size: output side in pixels.
        mean: per-channel normalisation mean.
        std: per-channel normalisation std.

    Returns:
        A callable from a PIL image to a ``(3, image_size, image_size)`` float tensor.
    """
    return T.Compose([
        T.Resize(image_size, interpolation=T.InterpolationMode.BICUBIC),
        T.CenterCrop(image_size),
        _to_rgb,
        T.ToTensor(),
        T.Normalize(mean, std),
    ])


def _to_rgb(image):  # a named function, not a lambda, so the transform pickles into workers
    return image.convert("RGB")


class RandomResizedCropFlip:
    """``RandomResizedCrop`` (bicubic) + optional ``RandomHorizontalFlip`` on a PIL image.

    torchvision's crop sampler (same area / log-aspect-ratio draws, ten tries, then a centre crop
    of the clamped ratio) on a Python ``random.Random`` instead of one-element torch tensors, which
    cost ~80 us per image in torchvision; the crop and the resize are Pillow's, as in torchvision.
    The training stream passes each sample its own RNG, drawn from (seed, epoch, sample)
    (:func:`~mmssl.data.pipeline.augmentation_rng`), so the crop of a sample does not depend on
    which worker reads it or on a resume; without one, the module-level ``random`` is used.

    Args:
        size: output side in pixels.
        scale: area range of the crop, as a fraction of the image.
        hflip: flip left-right with probability 0.5.
        ratio: aspect-ratio range of the crop (torchvision's default).
    """

    def __init__(self, size: int, scale: tuple[float, float] = (0.08, 1.0), hflip: bool = False,
                 ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> None:
        if not 0 < scale[0] <= scale[1] or not 0 < ratio[0] <= ratio[1]:
            raise ValueError(f"crop scale and ratio need 0 < low <= high, got scale={scale}, ratio={ratio}")
        self.size, self.scale, self.ratio, self.hflip = size, tuple(scale), tuple(ratio), hflip
        self._log_ratio = (math.log(ratio[0]), math.log(ratio[1]))

    def crop_box(self, width: int, height: int, rng: Optional[random.Random] = None) -> tuple[int, int, int, int]:
        """A random ``(left, top, right, bottom)`` crop of a ``width`` x ``height`` image, drawn from ``rng``."""
        draw = rng or random
        area = width * height
        for _ in range(10):
            target = area * draw.uniform(*self.scale)
            aspect = math.exp(draw.uniform(*self._log_ratio))
            w = int(round(math.sqrt(target * aspect)))
            h = int(round(math.sqrt(target / aspect)))
            if 0 < w <= width and 0 < h <= height:
                left, top = draw.randint(0, width - w), draw.randint(0, height - h)
                return left, top, left + w, top + h
        # Fallback (torchvision's): the whole image, cut to the nearest allowed aspect ratio.
        in_ratio = width / height
        if in_ratio < self.ratio[0]:
            w, h = width, int(round(width / self.ratio[0]))
        elif in_ratio > self.ratio[1]:
            w, h = int(round(height * self.ratio[1])), height
        else:
            w, h = width, height
        left, top = (width - w) // 2, (height - h) // 2
        return left, top, left + w, top + h

    def __call__(self, image: Image.Image, rng: Optional[random.Random] = None) -> Image.Image:
        reduced_from = image.info.get(REDUCED_FROM)
        if reduced_from is None:
            image = image.crop(self.crop_box(*image.size, rng)).resize((self.size, self.size), Image.BICUBIC)
        else:
            # A reduced-size JPEG decode (mmssl.data.decode.open_image): draw the crop on the stored
            # image's pixel grid, so areas, aspect ratios and positions follow the same law as a
            # full decode's (the same draws give the same box), and resample that box, in reduced
            # pixels (fractional), from the reduced image.
            width, height, scale = reduced_from
            box = tuple(v / scale for v in self.crop_box(width, height, rng))
            image = image.resize((self.size, self.size), Image.BICUBIC, box=box)
        if self.hflip and (rng or random).random() < 0.5:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        return image

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={self.size}, scale={self.scale}, ratio={self.ratio}, hflip={self.hflip})"


def to_uint8_tensor(image: Image.Image) -> torch.Tensor:
    """PIL image -> ``(3, H, W)`` uint8 RGB tensor (a view of the pixels, no scaling)."""
    if image.mode != "RGB":
        image = image.convert("RGB")
    return torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1)


class BatchNormalize:
    """``(B, 3, H, W)`` (or one ``(3, H, W)``) uint8 -> float ``(x / 255 - mean) / std``, one op.

    ``ToTensor`` + ``Normalize`` per image cost ~200 us of per-call overhead on small images;
    done once per batch in the collate step, the same values cost a few microseconds an image.
    On an accelerator the data module runs it after the transfer instead (uint8 crosses: a
    quarter of the bytes); its constants follow the images' device.

    Args:
        mean: per-channel mean, in [0, 1] units.
        std: per-channel standard deviation, in [0, 1] units.
    """

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        if len(mean) != 3 or len(std) != 3 or not all(math.isfinite(v) and v > 0 for v in std):
            raise ValueError(f"mean and std need 3 channels and std > 0, got mean={mean}, std={std}")
        self.mean, self.std = tuple(mean), tuple(std)
        std_t = torch.tensor(std, dtype=torch.float64).view(3, 1, 1)
        self._scale = (1.0 / (255.0 * std_t)).float()
        self._shift = (-torch.tensor(mean, dtype=torch.float64).view(3, 1, 1) / std_t).float()

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if images.dtype != torch.uint8:
            raise TypeError(f"BatchNormalize expects uint8 images, got {images.dtype}")
        if self._shift.device != images.device:  # on the accelerator, after the transfer
            self._shift, self._scale = self._shift.to(images.device), self._scale.to(images.device)
        # In place on the new float copy: half the time of one out-of-place addcmul on a CPU.
        return images.float().mul_(self._scale).add_(self._shift)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(mean={self.mean}, std={self.std})"


# create_transform arguments the data module sets itself (from image_size, crop_scale, hflip and
# the model's mean and std), so a recipe's ``train_augment`` cannot contradict them.
_SET_BY_MODULE = ("input_size", "is_training", "scale", "hflip", "mean", "std")


def timm_train_transform(
    image_size: int,
    mean: Sequence[float],
    std: Sequence[float],
    scale: tuple[float, float],
    hflip: bool,
    options: Mapping[str, Any],
) -> Callable:
    """timm's training transform (``create_transform(is_training=True)``), as MAE fine-tunes with.

    MAE ``util/datasets.py`` ``build_transform``: RandomResizedCrop (bicubic), flip, RandAugment
    (``auto_augment``), to tensor, normalise, random erasing (``re_prob``), all per sample.

    Args:
        image_size: output side in pixels.
        mean: per-channel normalisation mean.
        std: per-channel normalisation std.
        scale: area range of the random crop.
        hflip: random horizontal flip (probability 0.5).
        options: other ``create_transform`` arguments (``auto_augment``, ``re_prob``,
            ``re_mode``, ``re_count``, ``interpolation``, ``color_jitter``, ...).

    Returns:
        A callable ``(image, rng=None)`` from a PIL image to a normalised ``(3, S, S)`` float tensor.
    """
    clash = sorted(set(options) & set(_SET_BY_MODULE))
    if clash:
        raise ValueError(f"data.train_augment: {clash} are set by the data module (image_size, crop_scale, hflip, "
                         "image_mean, image_std); remove them there")
    try:
        transform = create_transform(input_size=image_size, is_training=True, scale=tuple(scale),
                                     hflip=0.5 if hflip else 0.0, mean=tuple(mean), std=tuple(std), **options)
    except TypeError as err:
        raise ValueError(f"data.train_augment: not an argument of timm.data.create_transform: {err}") from None
    replace_timm_augment_fn(transform, timm_auto_augment.posterize, _posterize)
    return SeededTransform(transform)


def _posterize(image: Image.Image, bits_to_keep: int, **kwargs: Any) -> Image.Image:
    """timm's ``posterize`` where keeping 0 bits gives a black image, as Pillow < 13 did.

    RandAugment's ``PosterizeIncreasing`` keeps ``4 - int(level / 10 * 4)`` bits, 0 at magnitude
    10 (reached by ``m9-mstd0.5`` draws, ~2% of them); Pillow 13 refuses 0 bits with a ValueError
    that would stop the loader. The result (every pixel 0) is what timm and MAE trained with.
    """
    if bits_to_keep <= 0:
        return Image.new(image.mode, image.size)
    return timm_auto_augment.posterize(image, bits_to_keep, **kwargs)


def timm_eval_transform(image_size: int, mean: Sequence[float], std: Sequence[float], crop_pct: float) -> Callable:
    """timm's eval transform: resize the short side to ``image_size / crop_pct``, centre crop.

    MAE ``util/datasets.py``: crop_pct 224 / 256 for inputs up to 224 pixels, 1.0 above.
    """
    if not 0.0 < crop_pct <= 1.0:
        raise ValueError(f"data.eval_crop_pct must be in (0, 1], got {crop_pct}")
    return create_transform(input_size=image_size, is_training=False, crop_pct=crop_pct, interpolation="bicubic",
                            mean=tuple(mean), std=tuple(std))


class SeededTransform:
    """Run a transform that draws from the global ``random``, numpy and torch RNGs (timm's do)
    from the sample's own RNG, then put the global states back.

    The training stream hands every sample an RNG drawn from (seed, epoch, sample)
    (:func:`~mmssl.data.pipeline.augmentation_rng`), so a sample is augmented alike whichever
    worker reads it and after a resume; timm's transforms take no RNG argument, hence the seeding
    here. In a loader without workers (the training process itself) the global states are put
    back, so drop path and Mixup keep their own streams.

    Args:
        transform: PIL image -> tensor.
    """

    def __init__(self, transform: Callable) -> None:
        self.transform = transform

    def __call__(self, image: Image.Image, rng: Optional[random.Random] = None) -> torch.Tensor:
        if rng is None:
            return self.transform(image)
        if get_worker_info() is not None:  # a loader worker: its global streams serve nothing else
            self._seed(rng)
            return self.transform(image)
        py_state, np_state, torch_state = random.getstate(), np.random.get_state(), torch.get_rng_state()
        try:
            self._seed(rng)
            return self.transform(image)
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)
            torch.set_rng_state(torch_state)

    @staticmethod
    def _seed(rng: random.Random) -> None:
        random.seed(rng.getrandbits(64))
        np.random.seed(rng.getrandbits(32))
        # The CPU generator only: torch.manual_seed also seeds every CUDA device (~0.5 ms a call).
        torch.default_generator.manual_seed(rng.getrandbits(63))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.transform!r})"
