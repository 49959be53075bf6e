"""Rank, world size and the ONE cross-rank gather of mmssl.

Every feature that crosses ranks (the contrastive losses' columns, the retrieval metrics'
embeddings) goes through :func:`gather_with_grad`, as open_clip routes both through
``loss.gather_features``. Outside ``torch.distributed`` (one CPU process, tests, notebooks) the
helpers answer rank 0 / world 1 and the gather is the identity, like lightly's ``utils/dist.py``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def is_distributed() -> bool:
    """True inside an initialised ``torch.distributed`` process group (Lightning DDP, torchrun)."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's global rank; 0 when not distributed."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """Number of processes; 1 when not distributed."""
    return dist.get_world_size() if is_distributed() else 1


def is_sharded(strategy: object) -> bool:
    """True when ``strategy`` shards parameters across ranks (FSDP 1 or FSDP2), so that every
    forward is a collective and a whole-model copy per rank cannot be assumed.

    The one "is this run sharded" question of mmssl: Lightning's ``FSDPStrategy`` (FSDP 1) and
    ``ModelParallelStrategy`` (FSDP2, ``fully_shard`` in ``configure_model``).
    """
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    return isinstance(strategy, (FSDPStrategy, ModelParallelStrategy))


def seed_per_rank(global_rank: int, num_ranks: int) -> None:
    """Give each rank its own torch RNG stream, derived from the run's seed and the rank.

    ``seed_everything`` seeds every rank alike, so every rank would draw the same MAE / FLIP masks
    and dropout; MAE's ``main_pretrain.py`` seeds ``args.seed + misc.get_rank()``, as here. Call it
    once per fit, on every rank (purely local: no collective). One process keeps its stream as
    it is, so single-process runs are unchanged by it.

    Args:
        global_rank: this process's rank.
        num_ranks: the number of processes.
    """
    if num_ranks > 1:
        torch.manual_seed(torch.initial_seed() + global_rank)


class _AllGather(torch.autograd.Function):
    """``torch.distributed.nn.functional.all_gather`` on public collectives: torch deprecates that
    module (FutureWarning at every step) for the private ``torch.distributed._functional_collectives``.

    Forward: (B, ...) -> world x (B, ...). Backward: each rank's rows get the sum over ranks of
    the gradients sent to them, a reduce-scatter (NCCL, XCCL), or an all-reduce of the stacked
    gradients where the backend has none (gloo), as torch's own emulates it.
    """

    @staticmethod
    def forward(ctx, x: Tensor) -> tuple[Tensor, ...]:
        x = x.contiguous()  # collectives need contiguous tensors
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x)
        return tuple(parts)

    @staticmethod
    def backward(ctx, *grads: Tensor) -> Tensor:
        stacked = torch.stack([g.contiguous() for g in grads])  # (world, B, ...)
        if dist.get_backend() in ("nccl", "xccl"):
            mine = torch.empty_like(stacked[0])
            dist.reduce_scatter_tensor(mine, stacked.flatten(0, 1))
            return mine
        dist.all_reduce(stacked)
        return stacked[dist.get_rank()]


def all_gather_with_grad(x: Tensor) -> list[Tensor]:
    """Every rank's ``x`` (the same shape on every rank), differentiable: world x (B, ...)."""
    return list(_AllGather.apply(x))


def gather_with_grad(x: Tensor, same_size: bool = False) -> Tensor:
    """Concatenate ``x`` from every rank in rank order, with gradients flowing back to each owner.

    open_clip ``loss.gather_features(gather_with_grad=True)``: the all-gather is differentiable
    (:class:`_AllGather`), and its backward sums the incoming gradients of each slice over
    ranks and returns them to the rank that produced it, so rank r's features get the gradient of
    every rank's loss terms that use them. Leading sizes may differ between ranks (validation
    shares): sizes are exchanged first, shorter tensors padded, the padding cut away.

    Args:
        x: (B_r, ...) this rank's rows; B_r may differ per rank, the other dims may not.
        same_size: every rank passes the same B (training batches, equal by construction): skip
            the exchange of sizes, a collective plus a host sync that would cost every step.

    Returns:
        (sum_r B_r, ...) rows of rank 0, then rank 1, ...; ``x`` itself when not distributed.
    """
    if not is_distributed():
        return x
    if same_size:
        return torch.cat(all_gather_with_grad(x), dim=0)  # world x (B, ...) -> (world * B, ...)
    world = dist.get_world_size()
    size = torch.tensor([x.shape[0]], device=x.device, dtype=torch.long)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    counts = [int(s.item()) for s in sizes]
    longest = max(counts)
    if x.shape[0] < longest:
        pad = x.new_zeros((longest - x.shape[0], *x.shape[1:]))
        x = torch.cat([x, pad], dim=0)  # (longest, ...)
    parts = all_gather_with_grad(x)  # world x (longest, ...), differentiable
    return torch.cat([part[:n] for part, n in zip(parts, counts)], dim=0)
