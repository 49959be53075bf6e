"""lightly's MAE as the peer of ``tools/benchmark.py --compare-lightly``.

The peer is lightly's own MAE code (``lightly.models.modules``: ``MaskedVisionTransformerTIMM``
around a timm ViT, ``MAEDecoderTIMM``, ``lightly.models.utils`` masking), assembled and trained the way
lightly's ``examples/pytorch/mae.py`` does it (a plain PyTorch loop), with every size taken from
the mmssl config being measured: image and patch size, encoder width, depth and heads, decoder
width, depth and heads, mask ratio. It reads the same shards through the same loader, builds its
optimizer with the config's optimizer factory, runs at the config's precision, and uses MAE's
per-patch normalised targets when the config does (``norm_pix_loss``). Only the model code and
the training loop differ, which is what the comparison is about.

lightly is optional (``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Any

import torch
from torch import nn

from benchmarks.meter import autocast_dtype, current_rss


def lightly_mae(hparams: Any) -> nn.Module:
    """lightly's MAE with the sizes of an ``mmssl.models.mae.MAE``'s hyper-parameters."""
    try:
        from lightly.models import utils
        from lightly.models.modules import masked_autoencoder_timm, masked_vision_transformer_timm
    except ImportError as err:
        raise RuntimeError("--compare-lightly needs lightly: pip install -e '.[bench]'") from err
    from timm.models.vision_transformer import VisionTransformer

    class LightlyMAE(nn.Module):
        """lightly ``examples/pytorch/mae.py``'s model; the loss is in ``forward``."""

        def __init__(self) -> None:
            super().__init__()
            vit = VisionTransformer(
                img_size=hparams.image_size, patch_size=hparams.patch_size, embed_dim=hparams.embed_dim,
                depth=hparams.depth, num_heads=hparams.num_heads, mlp_ratio=hparams.mlp_ratio, num_classes=0,
            )
            self.mask_ratio, self.patch_size = hparams.mask_ratio, hparams.patch_size
            self.norm_pix_loss = hparams.norm_pix_loss
            self.backbone = masked_vision_transformer_timm.MaskedVisionTransformerTIMM(vit=vit)
            self.sequence_length = self.backbone.sequence_length
            with warnings.catch_warnings():  # 1.6 names it deprecated; its examples still build it
                warnings.simplefilter("ignore", FutureWarning)
                self.decoder = masked_autoencoder_timm.MAEDecoderTIMM(
                    num_patches=vit.patch_embed.num_patches, patch_size=hparams.patch_size,
                    embed_dim=hparams.embed_dim, decoder_embed_dim=hparams.decoder_embed_dim,
                    decoder_depth=hparams.decoder_depth, decoder_num_heads=hparams.decoder_num_heads,
                    mlp_ratio=hparams.mlp_ratio, proj_drop_rate=0.0, attn_drop_rate=0.0,
                    mask_token=nn.Parameter(torch.zeros(1, 1, hparams.decoder_embed_dim)),
                )

        def forward(self, images: torch.Tensor) -> torch.Tensor:
            batch_size = images.shape[0]
            idx_keep, idx_mask = utils.random_token_mask(
                size=(batch_size, self.sequence_length), mask_ratio=self.mask_ratio, device=images.device
            )
            encoded = self.backbone.encode(images=images, idx_keep=idx_keep)
            x = self.decoder.embed(encoded)
            masked = utils.repeat_token(self.decoder.mask_token, (batch_size, self.sequence_length))
            masked = utils.set_at_index(masked, idx_keep, x.type_as(masked))
            pred = self.decoder.predict(utils.get_at_index(self.decoder.decode(masked), idx_mask))
            target = utils.get_at_index(utils.patchify(images, self.patch_size), idx_mask - 1)  # no cls
            if self.norm_pix_loss:  # MAE's norm_pix_loss, as the mmssl config has it
                target = (target - target.mean(-1, keepdim=True)) / (target.var(-1, keepdim=True) + 1e-6) ** 0.5
            return nn.functional.mse_loss(pred.float(), target.float())

    return LightlyMAE()


def run_lightly(cli: Any, warmup: int, steps: int) -> dict[str, Any]:
    """Train lightly's MAE for ``warmup + steps`` steps on the data of an instantiated mmssl CLI.

    Args:
        cli: an ``MMSSLCLI(run=False)`` of an MAE config (its model gives the sizes, its data
            module the batches, its trainer the device and precision).
        warmup: untimed steps.
        steps: timed steps.

    Returns:
        ``samples_per_s``, ``step_time_s`` (median), ``data_wait_fraction``, ``steps``,
        ``peak_memory_bytes`` (process peak RSS on CPU).
    """
    hparams = cli.model.hparams
    for key in ("image_size", "patch_size", "embed_dim", "decoder_embed_dim", "mask_ratio"):
        if key not in hparams:
            raise ValueError(f"--compare-lightly needs an MAE config (model.init_args.{key} is missing)")
    device = cli.trainer.strategy.root_device
    model = lightly_mae(hparams).to(device).train()
    optimizer = cli.model.optimizer(model.parameters())
    dtype = autocast_dtype(str(cli.trainer.precision))
    datamodule = cli.datamodule
    datamodule.setup("fit")
    batches = iter(datamodule.train_dataloader())
    step_times, waits, sizes = [], [], []
    peak_rss = 0
    last_end = time.perf_counter()
    for step in range(warmup + steps):
        batch = datamodule.on_before_batch_transfer(next(batches), 0)
        batch["image"] = batch["image"].to(device, non_blocking=True)
        images = datamodule.on_after_batch_transfer(batch, 0)["image"]  # uint8 normalised on a GPU
        fetched = time.perf_counter()
        autocast = torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
        with autocast:
            loss = model(images)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        end = time.perf_counter()
        if step >= warmup:
            step_times.append(end - last_end)
            waits.append(fetched - last_end)
            sizes.append(images.shape[0])
            peak_rss = max(peak_rss, current_rss())
        last_end = end
    total = sum(step_times)
    return {
        "tool": "lightly", "steps": len(step_times), "samples_per_s": sum(sizes) / total,
        "step_time_s": sorted(step_times)[len(step_times) // 2], "data_wait_fraction": sum(waits) / total,
        "peak_memory_bytes": peak_rss,
    }
