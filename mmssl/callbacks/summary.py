"""Tell the user, at the end, where the run went and what it reached."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_summary import get_formatted_model_size, get_human_readable_count

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


_RIGHT_ALIGNED = ("Params", "Params per Device", "In sizes", "Out sizes")


def summarize_without_flops(summary_data: list[tuple[str, list[str]]], total_parameters: int,
                            trainable_parameters: int, model_size: float, total_training_modes: dict[str, int],
                            total_flops: int = 0, rich: bool = False, flops_note: Optional[str] = None,
                            **kwargs: Any) -> None:
    """Lightning's model table (``ModelSummary.summarize``'s arguments) without its FLOPs column and
    total: Lightning counts them as one forward of ``example_input_array``, so a module without one
    shows zeros. The training step's count is :class:`RunSummary`'s, printed after step 0.

    Args:
        summary_data: the table's columns, ``(name, values)``.
        total_parameters, trainable_parameters, model_size, total_training_modes: the totals.
        total_flops: Lightning's count, not shown.
        rich: draw with rich (as ``RichModelSummary``), else as text (as ``ModelSummary``).
        flops_note: a last line, ``FLOPs per step: NOTE`` (where the count is found).
        **kwargs: ``header_style`` for rich.
    """
    columns = [(name, [str(v) for v in values]) for name, values in summary_data if name != "FLOPs"]
    totals = [("Trainable params", get_human_readable_count(trainable_parameters)),
              ("Non-trainable params", get_human_readable_count(total_parameters - trainable_parameters)),
              ("Total params", get_human_readable_count(total_parameters)),
              ("Total estimated model params size (MB)", get_formatted_model_size(model_size)),
              ("Modules in train mode", str(total_training_modes["train"])),
              ("Modules in eval mode", str(total_training_modes["eval"]))]
    note = [f"FLOPs per step: {flops_note}"] if flops_note else []
    if rich:
        from rich import get_console
        from rich.table import Table

        table = Table(header_style=kwargs.get("header_style", "bold magenta"))
        for name, _ in columns:
            table.add_column(name, justify="right" if name in _RIGHT_ALIGNED else "left", no_wrap=name == "Name")
        for row in zip(*(values for _, values in columns)):
            table.add_row(*row)
        console = get_console()
        console.print(table)
        for key, value in totals:
            console.print(f"[bold]{key}[/]: {value}")
        for line in note:
            console.print(line)
        return
    widths = [max([len(name), *map(len, values)]) for name, values in columns]
    lines = [" | ".join(name.ljust(w) for (name, _), w in zip(columns, widths)), "-" * (sum(widths) + 3 * len(widths))]
    lines += [" | ".join(v.ljust(w) for v, w in zip(row, widths)) for row in zip(*(values for _, values in columns))]
    lines += ["-" * (sum(widths) + 3 * len(widths))] + [f"{value:<10} {key}" for key, value in totals] + note
    rank_zero_info("\n" + "\n".join(lines))


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
    A resumed run keeps the file its first start wrote. Rank 0 prints the count after step 0.

    Lightning's model table (``ModelSummary`` / ``RichModelSummary``) counts FLOPs as one forward of
    ``example_input_array``: for a module without one (every mmssl model) it would print a column
    of zeros and "Total FLOPs: 0", so the table is drawn without them
    (:func:`summarize_without_flops`).

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

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if pl_module.example_input_array is not None:  # Lightning counts that forward itself
            return
        for callback in trainer.callbacks:
            if type(callback) in (ModelSummary, RichModelSummary):  # its depth and options kept
                note = (
                    "forward + backward of the first step, printed after it and at the end"
                    if self.count_flops
                    else None
                )
                callback.summarize = functools.partial(summarize_without_flops, flops_note=note,
                                                       rich=type(callback) is RichModelSummary)

    def _hand_to_throughput(self, trainer: pl.Trainer) -> None:
        """Set ``flops_per_batch`` on the module (ThroughputMonitor's interface; purely local)."""
        module = trainer.lightning_module
        if self.flops_per_step_per_device is not None:
            module.flops_per_batch = self.flops_per_step_per_device // trainer.accumulate_grad_batches
        elif self.count_flops and trainer.global_step == 0:
            # Counted when step 0's last micro-batch is done; ThroughputMonitor looks for the
            # attribute once, after the first micro-batch, and skips FLOP/s while it is None.
            module.flops_per_batch = None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # Every rank counts (no collective involved); step 0 only, so a resumed run's steps run
        # with the default attention kernels as an uninterrupted run's did.
        if self.count_flops and trainer.global_step == 0 and self._counting is None and self._counter is None:
            self._counting = contextlib.ExitStack()
            self._counter = self._counting.enter_context(count_flops())

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        # After the last micro-batch's backward, before the step and other callbacks' batch-end
        # work (image grids, probes), which is not training compute.
        self._stop_counting(trainer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
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
        print(f"mmssl: {per_device / 1e9:.3g} GFLOP per training step per device (forward + backward of step 0, "
              f"{COMPUTE_FILE})", flush=True)
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
