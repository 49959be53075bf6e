"""A callback that tests inject into real CLI runs to make one rank's gradients non-finite."""

from __future__ import annotations

import lightning.pytorch as pl


class PoisonGrads(pl.Callback):
    """After the backward of the optimizer steps ``steps``, set one gradient of rank ``rank`` to NaN
    (and of every rank on ``every_rank_steps``).

    ``on_after_backward`` runs after DDP has all-reduced the gradients, so only this rank sees the
    NaN: the other ranks skip the step only if ``NonFiniteGuard`` reduces its decision."""

    def __init__(self, rank: int, steps: list[int], every_rank_steps: list[int] = []) -> None:  # noqa: B006 (a CLI default)
        self.rank, self.steps, self.every_rank_steps = rank, set(steps), set(every_rank_steps)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step
        if (trainer.global_rank == self.rank and step in self.steps) or step in self.every_rank_steps:
            next(p for p in pl_module.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
