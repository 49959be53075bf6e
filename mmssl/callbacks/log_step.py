"""Log a resumed run's metrics at the steps the uninterrupted run logs them.

Lightning logs each training step's metrics at its count of optimizer-stepping batches
(``fit_loop.epoch_loop._batches_that_stepped``), which equals ``global_step`` with automatic
optimization and one optimizer. On a restart Lightning adds one to the restored count, assuming it
was saved before that batch's increment. That holds for a checkpoint written at the end of a step
or of a validation inside an epoch, not for one written at the end of the validation after an
epoch's last batch (``ModelCheckpoint``'s default, end-of-epoch trigger; Lightning 2.6): the
resumed run then logs every metric one step late (step ``s`` holds step ``s - 1``'s values, and
``log_every_n_steps`` picks other batches), although it trains exactly as the uninterrupted run.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from mmssl.upstream import lightning_logging_step, set_lightning_logging_step


class LogStepOnResume(pl.Callback):
    """Put Lightning's logging step back on ``global_step`` at the first batch after a resume.

    Acts once, on a resumed run (``trainer.ckpt_path`` set) with automatic optimization and one
    optimizer, and only when the logging step is exactly one ahead of ``global_step``: the
    restart's extra increment, which is the only way they differ in such a run.
    """

    def __init__(self) -> None:
        self._check = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check = trainer.ckpt_path is not None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._check:
            return
        self._check = False
        if (pl_module.automatic_optimization and len(trainer.optimizers) == 1
                and lightning_logging_step(trainer) == trainer.global_step + 1):
            set_lightning_logging_step(trainer, trainer.global_step)
