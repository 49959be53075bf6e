"""Losses as pure functions of tensors: no stored rank, world size or module state."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def clip_loss(
    image_features: Tensor,
    text_features: Tensor,
    logit_scale: Tensor,
    all_image_features: Optional[Tensor] = None,
    all_text_features: Optional[Tensor] = None,
    offset: int = 0,
    chunk_size: Optional[int] = None,
) -> Tensor:
    """Symmetric InfoNCE of CLIP (Radford et al. 2021, Fig. 3), pair i matching pair i.

    With the gathered features of all ranks this is open_clip's ``ClipLoss(local_loss=True,
    gather_with_grad=True)``: this rank's B rows against all N columns, the positives at
    ``offset + i``. The mean over ranks of these local losses is the loss of one process on the
    concatenated batch, so DDP's gradient averaging yields the global gradient. Written here
    rather than wrapping ``open_clip.loss.ClipLoss`` because that module stores rank and world
    size and gathers inside; mmssl gathers once, in ``mmssl.distributed`` (tests check the two
    agree).

    Args:
        image_features: (B, D) L2-normalised image embeddings of this rank.
        text_features: (B, D) L2-normalised text embeddings, row i paired with image i.
        logit_scale: scalar, the temperature's inverse (already exponentiated).
        all_image_features: (N, D) image embeddings of every rank; ``None``: this rank's only.
        all_text_features: (N, D) text embeddings of every rank; ``None``: this rank's only.
        offset: index of this rank's first row among the N (``rank * B`` with equal batches).
        chunk_size: ``None``: the (B, N) logits whole, as above. An integer >= 1: the same loss and
            gradients, the columns taken ``chunk_size`` at a time and never held whole
            (:func:`chunked_clip_loss`).

    Returns:
        Scalar: mean of the image->text and text->image cross-entropies over this rank's rows.
    """
    all_image = image_features if all_image_features is None else all_image_features
    all_text = text_features if all_text_features is None else all_text_features
    if chunk_size is not None:
        return chunked_clip_loss(image_features, text_features, logit_scale, all_image, all_text, offset, chunk_size)
    logits_per_image = logit_scale * image_features @ all_text.T  # (B, N)
    logits_per_text = logit_scale * text_features @ all_image.T  # (B, N)
    labels = torch.arange(image_features.shape[0], device=image_features.device) + offset  # (B,)
    return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_text, labels)) / 2


def siglip_loss(
    image_features: Tensor,
    text_features: Tensor,
    logit_scale: Tensor,
    logit_bias: Tensor,
    all_text_features: Optional[Tensor] = None,
    offset: int = 0,
    chunk_size: Optional[int] = None,
) -> Tensor:
    """Sigmoid loss of SigLIP (Zhai et al. 2023, Algorithm 1): every pair a binary decision.

    ``-sum_ij log sigmoid(z_ij (t x_i.y_j + b)) / B`` with z = +1 for the matching pair, -1
    otherwise, summed over this rank's B images and the texts of all ranks: what open_clip's
    ``SigLipLoss`` computes with its neighbour exchange, here from one all-gather of the texts
    (``mmssl.distributed.gather_with_grad``). Dividing by the local B makes the mean over ranks
    equal the single-process loss on the concatenated batch, as for :func:`clip_loss`.

    Args:
        image_features: (B, D) L2-normalised image embeddings of this rank.
        text_features: (B, D) L2-normalised text embeddings, row i paired with image i.
        logit_scale: scalar t (already exponentiated; SigLIP initialises it to 10).
        logit_bias: scalar b (SigLIP initialises it to -10).
        all_text_features: (N, D) text embeddings of every rank; ``None``: this rank's only.
        offset: index of this rank's first row among the N.
        chunk_size: ``None``: the (B, N) logits whole. An integer >= 1: the same loss and
            gradients, the columns taken ``chunk_size`` at a time (:func:`chunked_siglip_loss`).

    Returns:
        Scalar loss.
    """
    all_text = text_features if all_text_features is None else all_text_features
    if chunk_size is not None:
        return chunked_siglip_loss(image_features, logit_scale, logit_bias, all_text, offset, chunk_size)
    logits = logit_scale * image_features @ all_text.T + logit_bias  # (B, N)
    rows = torch.arange(image_features.shape[0], device=logits.device)  # (B,)
    labels = -torch.ones_like(logits)  # (B, N): -1 for negatives ...
    labels[rows, rows + offset] = 1.0  # ... +1 for each image's own caption
    return -F.logsigmoid(labels * logits).sum() / image_features.shape[0]


# Chunked contrastive losses ---------------------------------------------------------------------
#
# The dense losses above hold, for the backward, the (B, N) logits and the tensors of the same
# size that their softmax / log-sigmoid and cross-entropy save: several B x N x 4 bytes per step,
# N the global batch (B = 4,096 rows against N = 32,768 columns: 512 MiB each). The two autograd
# Functions below take the columns ``chunk_size`` at a time in the forward, keep only the
# features and a (B,) vector, and rebuild each block's logits in the backward (the recomputation
# that GradCache applies to the towers, mmssl/models/gradcache.py, applied to the loss; Inf-CL,
# Cheng et al. 2024, tiles the softmax loss the same way). open_clip's ``SigLipLoss(chunk_size)``
# (open_clip PR #1145) bounds only the forward's block: autograd still saves every block's
# logits (open_clip PR #1214 measures it), which these Functions do not.


def _autocast_state(device_type: str) -> tuple[str, bool, torch.dtype]:
    """The forward's autocast state, replayed in the backward (which autograd runs outside it),
    as ``torch.amp.custom_fwd`` / ``custom_bwd`` do for one fixed device type."""
    return device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def _blocks(cols: Tensor, chunk_size: int) -> list[tuple[int, Tensor]]:
    """(first column, (c, D) block) of each block of ``chunk_size`` columns; the last may be smaller."""
    return [(start * chunk_size, block) for start, block in enumerate(cols.split(chunk_size))]


class _LogSumExpOverColumns(torch.autograd.Function):
    """``lse_i = log sum_j exp(t r_i . c_j)``: each row's log-partition over all N columns, exact.

    Why exact: the columns split into blocks J_1..J_K, and ``log sum_{j} exp(x_j) =
    logaddexp_k(log sum_{j in J_k} exp(x_j))`` (associativity of the sum inside the log), so the
    running ``logaddexp`` of the blocks' logsumexps is the dense one up to float rounding (the
    online softmax of Milakov & Gimelshein 2018, one block at a time). The gradient of lse_i with
    respect to logit ij is the softmax ``p_ij = exp(x_ij - lse_i)``; with the upstream g_i and
    logits ``x = (t R) C^T``, a block's ``G = g p`` (B, c) gives ``dC_J = G^T (t R)``,
    ``d(t R) += G C_J``, then ``dR = t d(t R)`` and ``dt = sum(d(t R) * R)``: the chain rule of
    the dense graph, evaluated block by block from the saved ``lse``.

    Saves: R (B, D), C (N, D), t and lse (B,); the dense graph saves the (B, N) logits and their
    softmax besides. Working memory: one (B, chunk_size) block in each pass.
    """

    @staticmethod
    def forward(ctx, rows: Tensor, cols: Tensor, scale: Tensor, chunk_size: int) -> Tensor:
        scaled = scale * rows  # (B, D): grouped as the dense ``logit_scale * image @ all_text.T``
        lse = None
        for _, block in _blocks(cols, chunk_size):
            logits = scaled @ block.T  # (B, c)
            part = torch.logsumexp(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=1)  # (B,)
            lse = part if lse is None else torch.logaddexp(lse, part)
        ctx.save_for_backward(rows, cols, scale, lse)
        ctx.chunk_size, ctx.autocast = chunk_size, _autocast_state(rows.device.type)
        return lse

    @staticmethod
    def backward(ctx, grad_lse: Tensor) -> tuple[Optional[Tensor], ...]:
        rows, cols, scale, lse = ctx.saved_tensors

        def weights(logits: Tensor, start: int) -> Tensor:  # (B, c): upstream x softmax, in place where it can
            p = logits.to(lse.dtype).sub_(lse[:, None]).exp_()
            return p.mul_(grad_lse[:, None]).to(logits.dtype)

        return (*_block_backward(ctx, rows, cols, scale, None, weights)[:3], None)


class _SigmoidLossOverColumns(torch.autograd.Function):
    """``sum_ij -log sigmoid(z_ij (t r_i . c_j + b))``, z = +1 at column ``offset + i``, else -1.

    Why exact: the sum over j splits over the column blocks with no coupling between them (each
    pair is its own binary decision, SigLIP sec. 3), so the forward is a sum of block sums, each
    with the dense formula and the block's own signs (row i's positive falls in the block holding
    column offset + i: the block's diagonal ``offset - start``). With upstream g, the gradient of
    the term ij with respect to its logit x_ij is ``G_ij = -g z_ij sigmoid(-z_ij x_ij)``; then
    ``dC_J = G^T (t R)``, ``d(t R) += G C_J``, ``db = sum G``, ``dR = t d(t R)`` and
    ``dt = sum(d(t R) * R)``, block by block in the backward, the logits recomputed.

    Saves: R (B, D), C (N, D), t and b; the dense graph saves the (B, N) logits, their signs and
    the signed logits besides. Working memory: one (B, chunk_size) block in each pass.
    """

    @staticmethod
    def forward(ctx, rows: Tensor, cols: Tensor, scale: Tensor, bias: Tensor, offset: int, chunk_size: int) -> Tensor:
        scaled = scale * rows  # (B, D)
        total = None
        for start, block in _blocks(cols, chunk_size):
            logits = scaled @ block.T + bias  # (B, c)
            part = -F.logsigmoid(_signed(logits, offset - start)).sum()
            total = part if total is None else total + part
        ctx.save_for_backward(rows, cols, scale, bias)
        ctx.offset, ctx.chunk_size, ctx.autocast = offset, chunk_size, _autocast_state(rows.device.type)
        return total

    @staticmethod
    def backward(ctx, grad_total: Tensor) -> tuple[Optional[Tensor], ...]:
        rows, cols, scale, bias = ctx.saved_tensors

        def weights(logits: Tensor, start: int) -> Tensor:  # (B, c): d(-log sigmoid(z x)) / dx = -z sigmoid(-z x)
            g = torch.sigmoid_(_signed(logits, ctx.offset - start).neg_())  # sigmoid(-z x), in place
            g.diagonal(ctx.offset - start).neg_()  # times -z: +1 for the negatives, -1 for the positives
            return g.mul_(grad_total)

        return (*_block_backward(ctx, rows, cols, scale, bias, weights), None, None)


def _block_backward(ctx: Any, rows: Tensor, cols: Tensor, scale: Tensor, bias: Optional[Tensor],
                    weights: Callable[[Tensor, int], Tensor]) -> tuple[Optional[Tensor], ...]:
    """Gradients of rows, cols, scale and bias from each block's recomputed logits ``(t R) C_J^T + b``
    and ``weights(logits, start)`` = dLoss/dlogits of the block, (B, c); ``None`` where not needed.
    Runs under the forward's autocast state; sums over blocks accumulate in fp32 (or wider)."""
    device_type, enabled, dtype = ctx.autocast
    with torch.autocast(device_type, dtype=dtype, enabled=enabled):
        scaled = scale * rows  # (B, D)
        accumulate = torch.promote_types(scaled.dtype, torch.float32)
        grad_scaled = torch.zeros(scaled.shape, dtype=accumulate, device=scaled.device)  # d(t R), (B, D)
        grad_bias = torch.zeros((), dtype=accumulate, device=scaled.device)
        grad_cols = torch.empty_like(cols) if ctx.needs_input_grad[1] else None  # (N, D)
        for start, block in _blocks(cols, ctx.chunk_size):
            logits = scaled @ block.T  # (B, c), recomputed
            if bias is not None:
                logits = logits + bias
            g = weights(logits, start)  # (B, c)
            grad_scaled += g @ block
            if bias is not None:
                grad_bias += g.sum()
            if grad_cols is not None:
                grad_cols[start:start + block.shape[0]] = g.T @ scaled  # (c, D)
    needs = ctx.needs_input_grad
    return (
        (grad_scaled * scale).to(rows.dtype) if needs[0] else None,
        grad_cols,
        (grad_scaled * rows).sum().reshape(scale.shape).to(scale.dtype) if needs[2] else None,
        grad_bias.reshape(bias.shape).to(bias.dtype) if bias is not None and needs[3] else None,
    )


def _signed(logits: Tensor, diagonal: int) -> Tensor:
    """``z * logits`` in place, (B, c): z = -1, and +1 on ``diagonal`` (row i's own column, i + diagonal,
    where the block holds it; the diagonal is empty where it holds none). Negating is exact: the
    dense loss's ``labels * logits``, bit for bit, without a (B, c) tensor of signs."""
    signed = logits.neg_()
    signed.diagonal(diagonal).neg_()
    return signed


def _check_chunking(rows: Tensor, cols: Tensor, offset: int, chunk_size: int) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: an integer >= 1 (or None), got {chunk_size!r}")
    if not 0 <= offset <= cols.shape[0] - rows.shape[0]:
        raise ValueError(f"offset {offset}: the positives of {rows.shape[0]} rows fall outside the "
                         f"{cols.shape[0]} columns")


def chunked_clip_loss(
    image_features: Tensor,
    text_features: Tensor,
    logit_scale: Tensor,
    all_image_features: Tensor,
    all_text_features: Tensor,
    offset: int,
    chunk_size: int,
) -> Tensor:
    """:func:`clip_loss`, the (B, N) logits never whole: equal in value and every gradient.

    Each direction is a cross-entropy over N columns, ``lse_i - x_{i, offset+i}``: the
    log-partition over the columns in blocks (:class:`_LogSumExpOverColumns`), minus the positive
    logit ``t r_i . c_{offset+i}`` taken directly, (B, D) work. The roles are those of the dense
    loss: image->text has this rank's images as rows and every rank's texts as columns,
    text->image this rank's texts against every rank's images, so under DDP each rank needs both
    gathered sides, as the dense loss does.

    Args: as :func:`clip_loss` (the gathered features given), with ``chunk_size`` >= 1 columns per block.

    Returns:
        Scalar, equal to ``clip_loss(...)`` up to float rounding.
    """
    _check_chunking(image_features, all_text_features, offset, chunk_size)
    _check_chunking(text_features, all_image_features, offset, chunk_size)

    def cross_entropy(rows: Tensor, cols: Tensor) -> Tensor:
        lse = _LogSumExpOverColumns.apply(rows, cols, logit_scale, chunk_size)  # (B,)
        positive = (logit_scale * rows * cols[offset:offset + rows.shape[0]]).sum(dim=-1)  # (B,): x_{i, offset+i}
        return (lse - positive.to(lse.dtype)).mean()

    return (cross_entropy(image_features, all_text_features) + cross_entropy(text_features, all_image_features)) / 2


def chunked_siglip_loss(
    image_features: Tensor,
    logit_scale: Tensor,
    logit_bias: Tensor,
    all_text_features: Tensor,
    offset: int,
    chunk_size: int,
) -> Tensor:
    """:func:`siglip_loss`, the (B, N) logits never whole (:class:`_SigmoidLossOverColumns`):
    equal in value and every gradient, this rank's B images as rows, every rank's texts as columns.

    Args: as :func:`siglip_loss` (the gathered texts given), with ``chunk_size`` >= 1 columns per block.

    Returns:
        Scalar, equal to ``siglip_loss(...)`` up to float rounding.
    """
    _check_chunking(image_features, all_text_features, offset, chunk_size)
    total = _SigmoidLossOverColumns.apply(image_features, all_text_features, logit_scale, logit_bias, offset,
                                          chunk_size)  # sum over this rank's B x N pairs
    return total / image_features.shape[0]


def mae_loss(
    target: torch.Tensor,
    pred: torch.Tensor,
    mask: torch.Tensor,
    norm_pix_loss: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Mean squared error on the masked patches only (MAE ``forward_loss``).

    MAE sec. 3: "we compute the loss only on masked patches"; with ``norm_pix_loss`` each
    target patch is normalised by its own pixel mean and variance (the released models' setting,
    which the paper's Table 1d finds improves representations).

    Args:
        target: (B, L, p*p*C) true pixels per patch (``mmssl.models.masking.patchify`` of the
            images; patches rather than images so this module imports nothing from ``models``).
        pred: (B, L, p*p*C) predicted pixels per patch.
        mask: (B, L), 1 = masked (loss counted), 0 = visible (ignored).
        norm_pix_loss: normalise each target patch to zero mean, unit variance.
        eps: added to the variance, as in MAE.

    Returns:
        Scalar loss: the per-patch mean squared error averaged over masked patches.
    """
    loss = mae_patch_losses(target, pred, norm_pix_loss, eps)  # (B, L)
    mask = mask.to(loss.dtype)
    return (loss * mask).sum() / mask.sum().clamp_min(1.0)


def mae_patch_losses(target: torch.Tensor, pred: torch.Tensor, norm_pix_loss: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """(B, L, p*p*C) true and predicted pixels -> (B, L) each patch's mean squared error, the target
    patch normalised by its own mean and variance with ``norm_pix_loss`` (see :func:`mae_loss`)."""
    if target.shape != pred.shape:
        raise ValueError(f"mae_loss: target {tuple(target.shape)} and pred {tuple(pred.shape)} differ")
    target = target.float()
    if norm_pix_loss:
        mean = target.mean(dim=-1, keepdim=True)  # (B, L, 1)
        var = target.var(dim=-1, keepdim=True)  # unbiased, as MAE's torch.var
        target = (target - mean) / (var + eps) ** 0.5
    return (pred.float() - target).pow(2).mean(dim=-1)  # (B, L) per-patch MSE
