"""Passes of an open_clip ViT image tower beside its plain forward, for the objectives that read its
tokens: the EMA teacher's targets (:mod:`mmssl.objectives.self_distill`), patches behind a mask token
(:mod:`mmssl.objectives.masked_features`, iBOT / TIPS) and MAE's encoder on the visible patches with
its decoder (:mod:`mmssl.objectives.masked_image`). Each runs open_clip's own
``forward_intermediates``; the masked ones edit the tokens at the input of ``ln_pre`` (after the
class token and the position embedding), through a forward pre-hook held for the one pass. The host
module calls them inside its forward, so a sharded tower gathers its weights as for any step.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor, nn

from mmssl.models.masking import gather_tokens, patchify, random_masking


def patch_norm(visual: nn.Module) -> bool:
    """Whether patch tokens take the final norm: open_clip applies ``ln_post`` to the attention
    pool's output when the tower has one (CoCa), and it is then of the pool's width."""
    return getattr(visual, "attn_pool", None) is None


def last_tokens(visual: nn.Module, images: Tensor, edit: Optional[Callable[[Tensor], Tensor]] = None,
                prefix: bool = False) -> Tensor:
    """(B, 3, H, W) -> the last block's patch tokens (B, L', D) (with the class token first where
    ``prefix``), normed as :func:`patch_norm` says; ``edit`` maps the (B, 1 + L, D) tokens at the
    input of ``ln_pre`` to those the blocks see."""
    handle = None
    if edit is not None:
        handle = visual.ln_pre.register_forward_pre_hook(lambda module, args: (edit(args[0]), *args[1:]))
    try:
        out = visual.forward_intermediates(images, indices=1, normalize_intermediates=patch_norm(visual),
                                           intermediates_only=True, output_fmt="NLC", output_extra_tokens=prefix)
    finally:
        if handle is not None:
            handle.remove()
    tokens = out["image_intermediates"][-1]
    return torch.cat([out["image_intermediates_prefix"][-1], tokens], dim=1) if prefix else tokens


def image_targets(visual: nn.Module, images: Tensor) -> dict[str, Tensor]:
    """(B, 3, H, W) -> ``pooled`` (B, E), the unnormalised image embedding, and ``patches`` (B, L, D),
    the last block's patch tokens (:func:`last_tokens`), from one pass of the tower."""
    out = visual.forward_intermediates(images, indices=1, normalize_intermediates=patch_norm(visual),
                                       output_fmt="NLC")
    return {"pooled": out["image_features"], "patches": out["image_intermediates"][-1]}


def masked_patch_tokens(visual: nn.Module, images: Tensor, patch_mask: Tensor, token: Tensor) -> Tensor:
    """(B, 3, H, W), (B, L) bool, (1, 1, D) -> (B, L, D) patch tokens (as :func:`image_targets`),
    the masked patches' embeddings replaced by ``token`` (iBOT: the token in place of the patch
    embedding, then the position embedding; here their sum, swapped in at the input of ``ln_pre``)."""
    def swap(x: Tensor) -> Tensor:  # (B, 1 + L, D) after the position embedding
        masked = (token + visual.positional_embedding[1:]).to(x.dtype)  # (1, L, D)
        return torch.cat([x[:, :1], torch.where(patch_mask.unsqueeze(-1), masked, x[:, 1:])], dim=1)

    return last_tokens(visual, images, swap)


def masked_reconstruction(visual: nn.Module, images: Tensor, noise: Tensor, mask_ratio: float,
                          decoder: nn.Module) -> dict[str, Tensor]:
    """MAE on the tower: (B, 3, H, W) images, (B, L) uniforms -> ``mae_pred`` and ``mae_target``
    (B, L, p*p*3), the decoder's and the true pixels of every patch, and ``mae_mask`` (B, L), 1 where
    a patch was masked (MAE's random masking of ``noise``, the smallest kept). The tower runs on its
    class token and the visible patches, dropped at the input of ``ln_pre``, its final norm on every
    token (MAE's encoder), then ``decoder`` (:class:`mmssl.models.mae.MAEDecoder`)."""
    masking = random_masking(noise.unsqueeze(-1), mask_ratio, noise=noise)
    tokens = last_tokens(visual, images, lambda x: torch.cat([x[:, :1], gather_tokens(x[:, 1:], masking.ids_keep)],
                                                             dim=1), prefix=True)
    return {"mae_pred": decoder(tokens, masking.ids_restore), "mae_mask": masking.mask,
            "mae_target": patchify(images, int(visual.patch_size[0]))}
