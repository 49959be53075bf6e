"""Tell the user, at the end, where the run went and what it reached."""

from __future__ import annotations

import math

import lightning.pytorch as pl


class RunSummary(pl.Callback):
    """Print the run folder, checkpoints and final metrics after ``fit`` / ``validate``."""

    def _report(self, trainer: pl.Trainer, what: str) -> None:
        if not trainer.is_global_zero:
            return
        lines = [f"\nmmssl {what} finished after {trainer.global_step} steps."]
        if trainer.log_dir:
            lines.append(f"  run folder:  {trainer.log_dir}")
        ckpt = trainer.checkpoint_callback
        if ckpt is not None and getattr(ckpt, "last_model_path", ""):
            lines.append(f"  checkpoint:  {ckpt.last_model_path}")
        if ckpt is not None and getattr(ckpt, "best_model_path", ""):
            lines.append(f"  best:        {ckpt.best_model_path}")
        for logger in trainer.loggers:
            lines.append(f"  {type(logger).__name__}: {logger.log_dir}")
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
