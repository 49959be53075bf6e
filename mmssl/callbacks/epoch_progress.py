"""Checkpoints written when a run stops inside an epoch say that the epoch is unfinished.

A fit that stops before its epoch's last batch (``max_steps`` reached, or ``trainer.should_stop``)
still ends the epoch loop through ``on_train_epoch_end``, where ``ModelCheckpoint`` saves
``last.ckpt``; Lightning 2.6 has counted the epoch as processed by then. Resumed, that checkpoint
reads as saved at an epoch's end: the run trains the rest of epoch 0 as epoch 1 and stops at the
next ``max_steps`` counting epoch 2, and the one after that finds ``max_epochs`` reached and trains
nothing ("train longer": ``--trainer.max_steps 2``, then 3, then 4, each with ``--ckpt_path last``,
stopped after 3 steps of a 312-step epoch with ``max_epochs=2``). Here such a checkpoint records
the epoch as still running, which Lightning resumes mid-epoch at the next batch, as it does a
checkpoint written at the end of a training step.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl


class UnfinishedEpoch(pl.Callback):
    """In a checkpoint saved at ``on_train_epoch_end`` of an epoch whose batches did not all run,
    count the epoch as started but not processed."""

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        fit = trainer.fit_loop
        current = fit.epoch_progress.current
        if not trainer.training or current.processed != current.completed + 1:
            return  # not saved between the epoch's processed and completed counts: not its end hooks
        batches = fit.epoch_loop.batch_progress
        if batches.is_last_batch or batches.current.ready >= trainer.num_training_batches:
            return  # the epoch ran to its end
        progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_progress")
        if not isinstance(progress, dict):
            return
        for counts in progress.values():  # "total" and "current"
            if isinstance(counts, dict) and counts.get("processed", 0) > counts.get("completed", 0):
                counts["processed"] -= 1
