"""A callback that tests inject into real CLI runs to make one rank's gradients non-finite."""

from __future__ import annotations

import lightning.pytorch as pl


class PoisonGrads(pl.Callback):
    """After the backward of the listed optimizer steps, set one gradient of rank ``rank`` to NaN.

    ``on_after_backward`` runs after DDP has all-reduced the gradients, so only this rank sees the
    NaN: the other ranks skip the step only if ``NonFiniteGuard`` reduces its decision."""

    def __init__(self, rank: int, steps: list[int]) -> None:
        self.rank, self.steps = rank, set(steps)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == self.rank and trainer.global_step in self.steps:
            next(p for p in pl_module.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
