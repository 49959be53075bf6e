"""Log MAE reconstructions as an image grid, to the loggers and as PNG files in the run folder."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from torchvision.utils import make_grid, save_image

from mmssl.evaluation.online import run_folder


class Reconstructions(Callback):
    """Every ``every_n_steps`` optimizer steps, show original / masked / reconstructed images.

    The same images (the first ``num_images`` of the first training batch) and the same masks
    (``seed``) are used every time, so successive grids show the model improving. Each row is one
    image: original, visible patches only, reconstruction, and reconstruction with the visible
    patches pasted back (the four panels of MAE's Fig. 2). Works with any module offering
    ``reconstruct(images, generator) -> (reconstruction, mask)`` and ``image_mean`` /
    ``image_std``.

    Args:
        every_n_steps: interval in optimizer steps; a final grid is also written at the end.
        num_images: rows in the grid.
        seed: seed of the mask drawn for the grid.
        zoom: integer nearest-neighbour upscaling of each panel, so small (e.g. 32-pixel demo)
            images stay legible in the PNG and TensorBoard.
    """

    def __init__(
        self, every_n_steps: int = 100, num_images: int = 8, seed: int = 0, zoom: int = 1
    ) -> None:
        if every_n_steps <= 0:
            raise ValueError("Reconstructions: init_args.every_n_steps (its trainer.callbacks entry) must be >= 1, "
                             f"got {every_n_steps}")
        if zoom < 1:
            raise ValueError(f"Reconstructions: init_args.zoom (its trainer.callbacks entry) must be >= 1, got {zoom}")
        self.zoom = zoom
        self.every_n_steps = every_n_steps
        self.num_images = num_images
        self.seed = seed
        self._images: torch.Tensor | None = None
        self._last_step = -1

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: dict, batch_idx: int
    ) -> None:
        if self._images is None:
            self._images = batch["image"][: self.num_images].detach().clone()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step % self.every_n_steps == 0 and step != self._last_step:
            self.log_grid(trainer, pl_module)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.global_step != self._last_step:
            self.log_grid(trainer, pl_module)

    def grid(self, pl_module: LightningModule) -> torch.Tensor:
        """The grid for the stored images: (3, H', W') floats in [0, 1]."""
        assert self._images is not None
        images = self._images.to(pl_module.device)
        generator = torch.Generator(device=pl_module.device).manual_seed(self.seed)
        was_training = pl_module.training
        pl_module.eval()
        try:
            recon, mask = pl_module.reconstruct(images, generator)  # (B, 3, H, W), (B, 1, H, W)
        finally:
            pl_module.train(was_training)
        mean = torch.tensor(pl_module.image_mean, device=images.device).view(1, 3, 1, 1)
        std = torch.tensor(pl_module.image_std, device=images.device).view(1, 3, 1, 1)
        original = images.float() * std + mean
        recon = recon.float() * std + mean
        masked = original * (1 - mask) + 0.5 * mask  # removed patches shown grey
        pasted = original * (1 - mask) + recon * mask
        panels = torch.stack([original, masked, recon, pasted], dim=1)  # (B, 4, 3, H, W)
        panels = panels.flatten(0, 1)  # (4B, 3, H, W), one row of 4 per image
        if self.zoom > 1:
            panels = F.interpolate(panels, scale_factor=self.zoom, mode="nearest")
        return make_grid(panels.clamp(0, 1).cpu(), nrow=4, padding=2, pad_value=1.0)

    @torch.no_grad()
    def log_grid(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Write the grid to each logger with ``add_image``, and as PNG in the run folder (rank 0)."""
        if self._images is None or not hasattr(pl_module, "reconstruct"):
            return
        self._last_step = trainer.global_step
        # Every rank runs the forward (under FSDP it all-gathers parameters, a collective);
        # only rank 0 writes.
        grid = self.grid(pl_module)
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            experiment = getattr(logger, "experiment", None)
            if hasattr(experiment, "add_image"):  # TensorBoard
                experiment.add_image("reconstructions", grid, global_step=trainer.global_step)
        folder = os.path.join(run_folder(trainer), "reconstructions")  # local: no broadcast
        os.makedirs(folder, exist_ok=True)
        save_image(grid, os.path.join(folder, f"step_{trainer.global_step:06d}.png"))
