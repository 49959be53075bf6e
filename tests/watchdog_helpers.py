"""Callbacks the watchdog's CLI tests add with ``--trainer.callbacks+=watchdog_helpers.X`` (tests/
is on the runs' PYTHONPATH)."""

from __future__ import annotations

import lightning.pytorch as pl


class RaiseAtStep(pl.Callback):
    """Rank ``rank`` raises ``RuntimeError(message)`` at the start of training step ``step``."""

    def __init__(self, rank: int, step: int, message: str) -> None:
        self.rank, self.step, self.message = rank, step, message

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            raise RuntimeError(self.message)
