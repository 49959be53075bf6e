"""Contrastive batches larger than memory: exact gradient caching (GradCache, Gao et al. 2021).

A contrastive loss couples every sample of the batch with every other, so gradient accumulation
over micro-batches is a different (smaller-batch) loss. GradCache (Gao et al., "Scaling Deep
Contrastive Learning Batch Size under Memory Limited Setup", 2021, Algorithm 1) keeps the loss
exact: 1) embed the batch chunk by chunk without keeping activations; 2) compute the loss on the
features of the whole batch (gathered across ranks) and its gradient with respect to them; 3)
re-run each chunk with autograd and backpropagate the cached feature gradients.

Here the three steps are one autograd graph with a checkpoint per chunk
(``torch.utils.checkpoint``, non-reentrant): step 1 is the checkpointed forward, which keeps each
chunk's inputs and (B_chunk, D) features but none of its activations; step 2 is the backward of
the loss down to the features; step 3 is the checkpoint's recomputation of the chunk, run when
the backward reaches it, followed by the chunk's own backward, which consumes the cached feature
gradient. PyTorch's autograd engine runs ready nodes latest-created first, so one chunk is
recomputed and backpropagated completely before the next one starts: memory holds one chunk's
activations at a time (measured in benchmarks/gradcache.py).

Why this design rather than GradCache's hand-written second pass with a backward per chunk:
the step keeps ONE ``loss.backward()``, the one Lightning's automatic optimization runs, so
everything built on it is unchanged: the DDP reducer all-reduces each gradient bucket once per
step (a parameter used by K chunks is one ``AccumulateGrad`` node whose inputs the engine sums
before the hook fires; no ``no_sync`` bookkeeping), mixed precision (the checkpoint replays the
autocast state and the GradScaler scales the one loss), ``accumulate_grad_batches``, gradient
clipping, the LR scheduler, ``NonFiniteGuard`` (``on_before_optimizer_step``) and checkpoints.
Manual optimization would have to re-implement each of those and would refuse Lightning's
``gradient_clip_val`` and ``accumulate_grad_batches`` outright.

The random state of each chunk is replayed exactly: ``preserve_rng_state=True`` saves the CPU
generator and the generator of the chunk's accelerator before the first pass and restores them
around the recomputation (then puts the current state back), so FLIP masks, dropout and drop path
are drawn identically in both passes (tested on the masks themselves), and the run's random
stream advances exactly as without chunking. ``determinism_check="default"`` makes PyTorch raise
if a recomputed tensor's shape or dtype differs from the first pass.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def cached_features(
    encode: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]],
    images: Tensor,
    tokens: Tensor,
    chunk_size: int,
) -> tuple[Tensor, Tensor]:
    """``encode(images, tokens)`` of the whole batch, run ``chunk_size`` samples at a time.

    The values equal one call on the whole batch (per-sample towers; FLIP masks and drop path
    draw per sample), and so do the gradients reaching the towers' parameters; only the
    activations of one chunk live at a time, rebuilt in the backward (see the module docstring).

    Args:
        encode: (b, 3, H, W) images and (b, L) tokens -> (b, D) image and (b, D) text features,
            e.g. ``lambda i, t: (clip.encode_image(i), clip.encode_text(t))``.
        images: (B, 3, H, W) this rank's batch.
        tokens: (B, L) token ids, row i paired with image i.
        chunk_size: samples per chunk, >= 1; the last chunk may be smaller. A batch no larger
            than one chunk runs plainly (nothing to save, no recomputation).

    Returns:
        (B, D) image features and (B, D) text features, in batch order.
    """
    if chunk_size < 1:
        raise ValueError(f"model.contrastive_chunk_size must be >= 1, got {chunk_size}")
    if images.shape[0] != tokens.shape[0]:
        raise ValueError(f"cached_features: {images.shape[0]} images but {tokens.shape[0]} captions")
    if images.shape[0] <= chunk_size:
        return encode(images, tokens)
    chunks = zip(images.split(chunk_size), tokens.split(chunk_size))
    if torch.is_grad_enabled():
        parts = [checkpoint(encode, i, t, use_reentrant=False, preserve_rng_state=True) for i, t in chunks]
    else:  # nothing to backpropagate: chunking only bounds the forward's working memory
        parts = [encode(i, t) for i, t in chunks]  # K x ((b, D), (b, D))
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])  # (B, D) each
