"""Per-sample random patch masking and the patch <-> image reshapes of MAE.

Shared by MAE's encoder and CLIP's image tower (FLIP masks image patches the same way). Follows
facebookresearch/mae ``models_mae.py`` (``random_masking``, ``patchify``, ``unpatchify``),
including its mask convention: 0 = kept (visible), 1 = removed (masked).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Masking(NamedTuple):
    """The result of :func:`random_masking`.

    Attributes:
        ids_keep: (B, L_keep) indices of the visible patches, in shuffled order.
        ids_restore: (B, L) the inverse permutation: ``shuffled[:, ids_restore]`` is back in
            patch order (the MAE decoder uses it to put mask tokens in place).
        mask: (B, L) float, 0 = kept, 1 = removed, in patch order.
    """

    ids_keep: torch.Tensor
    ids_restore: torch.Tensor
    mask: torch.Tensor


def num_kept(num_patches: int, mask_ratio: float) -> int:
    """Number of visible patches per sample: ``int(L * (1 - ratio))`` as in MAE.

    Args:
        num_patches: L, patches per image.
        mask_ratio: fraction removed, in [0, 1).

    Returns:
        L_keep, at least 1 so the encoder always sees a token besides cls.
    """
    return max(1, int(num_patches * (1.0 - mask_ratio)))


def random_masking(
    x: torch.Tensor,
    mask_ratio: float,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> Masking:
    """Draw an independent random subset of patches to keep for every sample.

    MAE sec. 3 "random sampling": shuffle the patches by the argsort of uniform noise and keep
    the first ``L_keep``; every sample keeps exactly the same number, so the visible tokens stay
    a dense (B, L_keep, D) tensor and the encoder really runs on fewer tokens.

    Args:
        x: (B, L, D) patch tokens; only its shape and device are used.
        mask_ratio: fraction of patches removed, in [0, 1).
        generator: optional RNG for reproducible masks (tests, visualisation).
        noise: (B, L) uniform noise to rank the patches by instead of drawing it (e.g.
            :func:`sample_noise`, which makes each sample's mask independent of its batch).

    Returns:
        :class:`Masking` with ``ids_keep`` (B, L_keep), ``ids_restore`` (B, L), ``mask`` (B, L).
    """
    if not 0.0 <= mask_ratio < 1.0:
        raise ValueError(f"mask_ratio must be in [0, 1), got {mask_ratio}")
    batch, length = x.shape[0], x.shape[1]
    len_keep = num_kept(length, mask_ratio)
    if noise is None:
        noise = torch.rand(batch, length, device=x.device, generator=generator)  # (B, L)
    ids_shuffle = torch.argsort(noise, dim=1)  # ascending: small noise is kept
    ids_restore = torch.argsort(ids_shuffle, dim=1)
    ids_keep = ids_shuffle[:, :len_keep]  # (B, L_keep)
    mask = torch.ones(batch, length, device=x.device)
    mask[:, :len_keep] = 0
    mask = torch.gather(mask, dim=1, index=ids_restore)  # unshuffle: (B, L) in patch order
    return Masking(ids_keep, ids_restore, mask)


def sample_noise(images: torch.Tensor, length: int, seed: int = 0) -> torch.Tensor:
    """(B, L) uniform noise that depends only on each image's pixels and ``seed``.

    Validation masks drawn from it are the same for a sample whichever batch, worker or rank it
    lands in, so N processes score the same masked patches as one process on the same data
    (masks seeded by batch index change with the split). Each image is hashed exactly (quantised
    pixels times fixed integer weights, summed in int64, so no float reduction order enters),
    and the hash seeds that sample's own generator.

    Args:
        images: (B, C, H, W) images as the model sees them.
        length: patches per image.
        seed: changes every mask at once.

    Returns:
        (B, L) float noise on ``images.device``.
    """
    pixels = torch.round(images.detach().float().flatten(1) * 64).to(torch.int64)  # (B, C*H*W)
    weights = torch.randint(1, 2**31 - 1, (pixels.shape[1],), generator=torch.Generator().manual_seed(seed))
    keys = (pixels * weights.to(pixels.device)).sum(dim=1).tolist()  # (B,) one host sync per batch
    rows = [torch.rand(length, generator=torch.Generator().manual_seed((k + seed) & (2**63 - 1))) for k in keys]
    return torch.stack(rows).to(images.device)  # (B, L)


def gather_tokens(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Select tokens per sample.

    Args:
        x: (B, L, D) tokens.
        ids: (B, K) indices into L.

    Returns:
        (B, K, D) ``x[b, ids[b]]``.
    """
    return torch.gather(x, dim=1, index=ids.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def patchify(imgs: torch.Tensor, patch_size: int) -> torch.Tensor:
    """Cut images into flattened patches in row-major patch order.

    Args:
        imgs: (B, C, H, W), H and W divisible by ``patch_size``.
        patch_size: p.

    Returns:
        (B, L, p*p*C) with L = (H/p)*(W/p); each patch flattened as (p, p, C) like MAE.
    """
    b, c, h, w = imgs.shape
    p = patch_size
    if h % p or w % p:
        raise ValueError(f"image size {h}x{w} is not divisible by patch_size={p}")
    x = imgs.reshape(b, c, h // p, p, w // p, p)  # (B, C, h, p, w, q)
    x = torch.einsum("nchpwq->nhwpqc", x)  # (B, h, w, p, q, C)
    return x.reshape(b, (h // p) * (w // p), p * p * c)


def unpatchify(
    x: torch.Tensor, patch_size: int, grid_size: tuple[int, int] | None = None
) -> torch.Tensor:
    """Inverse of :func:`patchify`.

    Args:
        x: (B, L, p*p*C) flattened patches.
        patch_size: p.
        grid_size: (h, w) patches per column / row; ``None`` assumes a square grid.

    Returns:
        (B, C, h*p, w*p) images.
    """
    b, length, dim = x.shape
    p = patch_size
    c = dim // (p * p)
    if grid_size is None:
        side = int(round(length**0.5))
        if side * side != length:
            raise ValueError(f"{length} patches do not form a square grid; pass grid_size")
        grid_size = (side, side)
    h, w = grid_size
    x = x.reshape(b, h, w, p, p, c)  # (B, h, w, p, q, C)
    x = torch.einsum("nhwpqc->nchpwq", x)  # (B, C, h, p, w, q)
    return x.reshape(b, c, h * p, w * p)
