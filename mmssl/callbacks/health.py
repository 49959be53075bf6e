"""Training health without labels: RankMe, alignment, uniformity, CLIP's modality gap and logit scale.

Label-free figures of the embedding, on a fixed held-out buffer, during training (the figures of
``mmssl.evaluation.health``; stable-pretraining's RankMe callback is the model)::

    trainer:
      callbacks:
        - class_path: mmssl.callbacks.EmbeddingHealth
          init_args: {max_samples: 256, collapse_threshold: 0.05}
"""

from __future__ import annotations

import math
import time
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from mmssl.data.heldout import HeldOut, read_heldout
from mmssl.data.transforms import eval_transform
from mmssl.evaluation.features import frozen_eval
from mmssl.evaluation.health import alignment, modality_gap, rankme, uniformity
from mmssl.evaluation.online import evaluation_set, will_evaluate

__all__ = ["EmbeddingHealth"]


class EmbeddingHealth(pl.Callback):
    """Log ``health/*`` figures of the model's embedding of a fixed held-out buffer.

    The buffer is the first ``max_samples`` samples of the held-out set, read once at start-up by
    every rank (:func:`mmssl.data.heldout.read_heldout`); each rank embeds an equal slice of it
    and the slices are gathered, so 1 and N processes log the same figures. Logged keys:

    - ``health/rankme``: effective rank of the image embeddings (Garrido et al. 2023), in
      ``[1, min(N, D)]``: ``encode_image`` (MAE: the cls token; CLIP: the normalised embedding);
    - ``health/uniformity``: Wang & Isola's uniformity (t=2) of the L2-normalised image embeddings;
    - ``health/alignment``: Wang & Isola's alignment (alpha=2) over positive pairs. For CLIP the
      pair is (image, its caption); an image-only model (MAE) has no pair in its objective, so the
      pair is (image, its horizontal flip), the one training augmentation of the recipes that is
      deterministic: the figure is the flip invariance of the embedding (one more forward);
    - for CLIP (a model with ``encode_text`` and ``tokenizer``): ``health/rankme_text``,
      ``health/uniformity_text``, ``health/modality_gap`` (Liang et al. 2022) and
      ``health/logit_scale`` (the exponentiated scale, as the loss uses it; ``health/logit_bias``
      for SigLIP), from the model's ``forward(images, tokens)``.

    When ``health/rankme`` falls below ``collapse_threshold x min(N, D)`` a warning is given once.

    Args:
        data: the held-out set (image-text shards, or a labelled set / image folder: images
            only); defaults to the data module's ``eval_data`` (the demo's labelled held-out
            split), else its ``val_data`` (when one pattern), as every evaluation callback
            (:func:`mmssl.evaluation.online.evaluation_set`).
        max_samples: N, the buffer's size (RankMe is bounded by min(N, D): keep N >= D). Held
            in memory as float images (224 px: 0.6 MB each).
        every_n_steps: ``None``: at the end of every validation (and on ``mmssl validate``); N:
            after every N-th optimizer step instead (also with validation off).
        collapse_threshold: warn when RankMe < this fraction of min(N, D); 0 never warns.
        batch_size: images per forward.
    """

    def __init__(
        self,
        data: Optional[str] = None,
        max_samples: int = 256,
        every_n_steps: Optional[int] = None,
        collapse_threshold: float = 0.05,
        batch_size: int = 256,
    ) -> None:
        if max_samples < 2:
            raise ValueError(f"EmbeddingHealth: init_args.max_samples must be >= 2, got {max_samples}")
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"EmbeddingHealth: init_args.every_n_steps must be >= 1 or null, got {every_n_steps}")
        if not 0 <= collapse_threshold <= 1:
            raise ValueError(
                f"EmbeddingHealth: init_args.collapse_threshold must lie in [0, 1], got {collapse_threshold}"
            )
        if batch_size < 1:
            raise ValueError(f"EmbeddingHealth: init_args.batch_size must be >= 1, got {batch_size}")
        self.data, self.max_samples, self.every_n_steps = data, max_samples, every_n_steps
        self.collapse_threshold, self.batch_size = collapse_threshold, batch_size
        self.buffer: Optional[HeldOut] = None
        self.last_call_ms: Optional[float] = None  # wall time of the last computation, for cost reports
        self._warned = False
        self._last_step: Optional[int] = None

    def _data(self, trainer: pl.Trainer) -> Optional[tuple[str, str]]:
        """The held-out set and the key that named it (for messages); ``None`` when there is none."""
        return evaluation_set(trainer.datamodule, self.data)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.every_n_steps is None and not will_evaluate(trainer, stage):
            return
        # Every rank reads the buffer at start-up, so a missing or empty set stops all of them at once.
        found = self._data(trainer)
        if found is None:  # e.g. unlabelled training shards and no val_data: nothing to watch
            self.buffer = None
            rank_zero_warn("EmbeddingHealth: no held-out set (data.val_data, or init_args.data in its "
                           "trainer.callbacks entry): the health/* figures are off for this run")
            return
        data, key = found
        dm = trainer.datamodule
        tokenizer = getattr(pl_module, "tokenizer", None) if hasattr(pl_module, "encode_text") else None
        transform = eval_transform(pl_module.image_size, pl_module.image_mean, pl_module.image_std)
        kwargs = {k: getattr(dm, k) for k in ("image_key", "text_key") if isinstance(getattr(dm, k, None), str)}
        if hasattr(dm, "max_image_pixels"):
            kwargs["max_image_pixels"] = dm.max_image_pixels
        try:
            self.buffer = read_heldout(data, transform, tokenizer, self.max_samples, **kwargs)
        except (FileNotFoundError, ValueError) as err:
            raise type(err)(f"EmbeddingHealth: {key}={data!r}: {err}") from err
        if len(self.buffer) < 2:
            raise ValueError(f"EmbeddingHealth: {key}={data!r} gave {len(self.buffer)} readable samples "
                             f"({self.buffer.skipped} skipped{', captions needed for a CLIP' if tokenizer else ''}); "
                             "the figures need at least 2")
        if self.buffer.skipped and trainer.is_global_zero:
            rank_zero_warn(
                f"EmbeddingHealth: {self.buffer.skipped} unreadable samples of {data!r} left out of the buffer"
            )

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or (self.every_n_steps is not None and trainer.state.fn == "fit"):
            return
        # Figures of the whole buffer, identical on every rank: sync_dist's mean keeps them.
        for name, value in self.evaluate(trainer, pl_module).items():
            pl_module.log(name, value, sync_dist=True)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if self.every_n_steps is None or step % self.every_n_steps or step == self._last_step:
            return  # (the same step again: gradient accumulation's micro-batches)
        self._last_step = step
        metrics = self.evaluate(trainer, pl_module)  # every rank: the forwards and the gather
        if trainer.is_global_zero:  # straight to the loggers: Lightning logs train hooks on its own cadence
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    def evaluate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, float]:
        """Every rank embeds its slice; returns the ``health/*`` figures of the whole buffer."""
        if self.buffer is None:
            return {}  # no held-out set (warned at setup): every rank alike, no collective
        start = time.perf_counter()
        embeddings = self._embed(trainer, pl_module)
        n, dim = len(self.buffer), embeddings["image"].shape[1]
        image = embeddings["image"]
        out = {"health/rankme": rankme(image), "health/uniformity": uniformity(image),
               "health/alignment": alignment(image, embeddings["pair"])}
        if self.buffer.tokens is not None:
            text = embeddings["pair"]
            out.update({"health/rankme_text": rankme(text), "health/uniformity_text": uniformity(text),
                        "health/modality_gap": modality_gap(image, text)})
            out.update({f"health/{k}": float(v) for k, v in embeddings.items() if k.startswith("logit_")})
        self.last_call_ms = 1000 * (time.perf_counter() - start)
        self._warn_if_collapsed(out["health/rankme"], min(n, dim), trainer.global_step)
        return out

    def _warn_if_collapsed(self, value: float, most: int, step: int) -> None:
        if self._warned or value >= self.collapse_threshold * most:
            return
        self._warned = True
        rank_zero_warn(
            f"EmbeddingHealth: RankMe {value:.2f} at step {step} is below collapse_threshold "
            f"{self.collapse_threshold} x {most} (the most it can be on this buffer): the embedding is "
            "collapsing onto few directions. Check the learning rate, warm-up and loss; this warning is given once."
        )

    def _slice(self, trainer: pl.Trainer) -> tuple[slice, int]:
        """This rank's rows of the buffer and the rows every rank embeds (ceil(N / W))."""
        n, world = len(self.buffer), trainer.world_size
        per = math.ceil(n / world)
        begin = min(trainer.global_rank * per, n)
        return slice(begin, min(begin + per, n)), per

    def _embed(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Tensor]:
        """``image`` (N, D), ``pair`` (N, D) (captions or flipped images) and, for CLIP, the logit scale."""
        rows, per = self._slice(trainer)
        images = self.buffer.images[rows]
        tokens = self.buffer.tokens[rows] if self.buffer.tokens is not None else None
        if len(images) < per:  # the last ranks' slices are padded with row 0, dropped after the gather
            pad = per - len(images)
            images = torch.cat([images, self.buffer.images[:1].expand(pad, *images.shape[1:])])
            if tokens is not None:
                tokens = torch.cat([tokens, self.buffer.tokens[:1].expand(pad, -1)])
        parts: dict[str, list[Tensor]] = {"image": [], "pair": []}
        extra: dict[str, Tensor] = {}
        device = pl_module.device
        with frozen_eval(pl_module):
            for i in range(0, per, self.batch_size):  # the same number of forwards on every rank
                batch = images[i:i + self.batch_size].to(device)
                with trainer.precision_plugin.forward_context():
                    if tokens is None:
                        image, pair = pl_module.encode_image(batch), pl_module.encode_image(batch.flip(-1))
                    else:
                        out = pl_module(batch, tokens[i:i + self.batch_size].to(device))
                        image, pair = out["image_features"], out["text_features"]
                        extra = {k: out[k].detach().float().cpu() for k in ("logit_scale", "logit_bias") if k in out}
                parts["image"].append(image.float())
                parts["pair"].append(pair.float())
        local = {k: torch.cat(v) for k, v in parts.items()}  # (per, D) each
        if trainer.world_size > 1:
            # (W, per, D) -> (W * per, D): rank r's rows are buffer rows r*per .. r*per+per-1.
            local = {k: pl_module.all_gather(v).reshape(-1, v.shape[1]) for k, v in local.items()}
        return {**{k: v[: len(self.buffer)].cpu() for k, v in local.items()}, **extra}
