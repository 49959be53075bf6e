"""Tell the user, at the end, where the run went and what it reached."""

from __future__ import annotations

import contextlib
import json
import math
import os
from typing import Any, Optional

import lightning.pytorch as pl

from mmssl.evaluation.online import run_folder
from mmssl.flops import COMPUTE_FILE, count_flops


def run_info(trainer: pl.Trainer) -> dict[str, float | int]:
    """The figures a user checks first at scale: world, batch, steps and learning rates.

    Returns:
        ``world_size``, ``num_nodes``, ``batch_size_per_device``, ``accumulate_grad_batches``,
        ``global_batch_size``, ``steps_per_epoch`` (optimizer steps), ``total_steps`` and the peak
        ``lr`` of each optimizer group (``lr_group{i}``).
    """
    datamodule = trainer.datamodule
    per_device = int(getattr(datamodule, "batch_size", 0) or 0)
    accumulate = trainer.accumulate_grad_batches
    batches = trainer.num_training_batches
    info: dict[str, float | int] = {
        "world_size": trainer.world_size,
        "num_nodes": trainer.num_nodes,
        "batch_size_per_device": per_device,
        "accumulate_grad_batches": accumulate,
        "global_batch_size": per_device * trainer.world_size * accumulate,
        "steps_per_epoch": int(batches // accumulate) if math.isfinite(batches) else -1,
        "total_steps": int(trainer.estimated_stepping_batches)
        if math.isfinite(trainer.estimated_stepping_batches) else -1,
    }
    for opt in trainer.optimizers:
        for i, group in enumerate(opt.param_groups):
            info[f"lr_group{i}"] = float(group.get("initial_lr", group["lr"]))
    return info


class RunSummary(pl.Callback):
    """Print the run's scale at the start, and where it went and what it reached at the end.

    At the start of training, ``run_info`` is printed on rank 0 and recorded in the loggers'
    hyper-parameters (``hparams.yaml`` in the run folder), so the world size of a run is saved
    beside its config.

    The first optimizer step of a fresh run (``global_step`` 0) runs under the project's FLOP
    counter (:func:`mmssl.flops.count_flops`: forward and backward of every micro-batch of
    the step, math attention), and rank 0 writes ``compute.json`` to the run folder:
    ``flops_per_step`` (this rank's count x world size: data-parallel ranks do the same work),
    ``flops_per_step_per_device``, ``world_size`` and ``global_batch_size``. Training compute up
    to step s is then ``flops_per_step * s`` (``tools/scaling_fit.py`` reads it, no model needed).
    A resumed run keeps the file its first start wrote.

    The count is also handed to Lightning's ``ThroughputMonitor`` (``mmssl.callbacks.Throughput``)
    the way it asks for it, as the module's ``flops_per_batch`` (per device and micro-batch), so
    it logs FLOP/s; the figure is saved in checkpoints, so a resumed run has it too.

    Args:
        count_flops: count and record the FLOPs of the first step (off: no ``compute.json``).
    """

    def __init__(self, count_flops: bool = True) -> None:
        self.count_flops = count_flops
        self._counting: Optional[contextlib.ExitStack] = None
        self._counter: Any = None
        self.flops_per_step_per_device: Optional[int] = None  # counted, or restored from a checkpoint

    def state_dict(self) -> dict[str, Any]:
        return {"flops_per_step_per_device": self.flops_per_step_per_device}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.flops_per_step_per_device = state_dict.get("flops_per_step_per_device")

    def _hand_to_throughput(self, trainer: pl.Trainer) -> None:
        """Set ``flops_per_batch`` on the module (ThroughputMonitor's interface; purely local)."""
        module = trainer.lightning_module
        if self.flops_per_step_per_device is not None:
            module.flops_per_batch = self.flops_per_step_per_device // trainer.accumulate_grad_batches
        elif self.count_flops and trainer.global_step == 0:
            # Counted when step 0's last micro-batch is done; ThroughputMonitor looks for the
            # attribute once, after the first micro-batch, and skips FLOP/s while it is None.
            module.flops_per_batch = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        # Every rank counts (no collective involved); step 0 only, so a resumed run's steps run
        # with the default attention kernels as an uninterrupted run's did.
        if self.count_flops and trainer.global_step == 0 and self._counting is None and self._counter is None:
            self._counting = contextlib.ExitStack()
            self._counter = self._counting.enter_context(count_flops())

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        # After the last micro-batch's backward, before the step and other callbacks' batch-end
        # work (image grids, probes), which is not training compute.
        self._stop_counting(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step > 0:  # a step that took no optimizer step (skipped) ends here
            self._stop_counting(trainer)

    def _stop_counting(self, trainer: pl.Trainer) -> None:
        if self._counting is None:
            return
        self._counting.close()
        self._counting = None
        per_device = int(self._counter.get_total_flops())
        self.flops_per_step_per_device = per_device
        self._hand_to_throughput(trainer)
        if not trainer.is_global_zero:
            return
        info = {
            "flops_per_step": per_device * trainer.world_size,
            "flops_per_step_per_device": per_device,
            "world_size": trainer.world_size,
            "global_batch_size": run_info(trainer)["global_batch_size"],
            "counter": "torch FlopCounterMode, forward + backward of step 0, math attention",
        }
        folder = run_folder(trainer)  # local; trainer.log_dir would be a broadcast
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, COMPUTE_FILE), "w") as f:
            json.dump(info, f, indent=1)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._hand_to_throughput(trainer)
        info = run_info(trainer)
        for logger in trainer.loggers:
            logger.log_hyperparams({f"run/{k}": v for k, v in info.items()})
        if trainer.is_global_zero:
            print("mmssl run: " + ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                                           for k, v in info.items()), flush=True)

    def _report(self, trainer: pl.Trainer, what: str) -> None:
        if not trainer.is_global_zero:
            return
        log_dir = run_folder(trainer)  # local; trainer.log_dir would be a broadcast
        lines = [f"\nmmssl {what} finished after {trainer.global_step} steps."]
        if log_dir:
            lines.append(f"  run folder:  {log_dir}")
        ckpt = trainer.checkpoint_callback
        if ckpt is not None and getattr(ckpt, "last_model_path", ""):
            lines.append(f"  checkpoint:  {ckpt.last_model_path}")
        if ckpt is not None and getattr(ckpt, "best_model_path", ""):
            lines.append(f"  best:        {ckpt.best_model_path}")
        for logger in trainer.loggers:
            lines.append(f"  {type(logger).__name__}: {logger.log_dir}")
        if what == "fit" and self.flops_per_step_per_device:
            # The count Lightning's model table cannot show (its FLOPs column needs an
            # example_input_array and counts a forward pass only).
            lines.append(f"  compute:     {self.flops_per_step_per_device / 1e9:.3g} GFLOP per step per device "
                         f"(forward + backward, {COMPUTE_FILE})")
        metrics = {
            k: float(v) for k, v in sorted(trainer.callback_metrics.items())
            if v.numel() == 1 and math.isfinite(float(v))
        }
        if metrics:
            lines.append("  final metrics:")
            lines += [f"    {k:<28} {v:.4f}" for k, v in metrics.items()]
        print("\n".join(lines), flush=True)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report(trainer, "fit")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "validate":
            self._report(trainer, "validate")
