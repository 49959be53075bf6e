"""An exponential moving average (EMA) of the weights, on Lightning's ``WeightAveraging``.

Composed onto MAE, CLIP or ImageClassifier from YAML::

    trainer:
      callbacks:
        - class_path: mmssl.callbacks.EMA
          init_args: {decay: 0.999, warmup_power: 0.75, evaluate: both}

The average is torch's ``AveragedModel`` with torch's EMA update (``get_ema_multi_avg_fn``: one
foreach ``lerp`` per device and dtype) over the parameters and the floating-point buffers
(``use_buffers=True``, as Lightning's default: BatchNorm statistics are averaged too); integer
buffers such as ``num_batches_tracked`` are copied, as timm's ``ModelEmaV3`` does, and so are
non-persistent buffers (constants that checkpoints do not hold, such as open_clip's causal
attention mask, whose ``-inf`` entries would average to ``nan``). Each rank
updates its own copy from the same (DDP-synchronised) weights, so the copies agree on every rank.

Checkpoints follow ``WeightAveraging``'s convention: ``state_dict`` holds the **averaged** weights
(so Lightning's ``load_from_checkpoint`` and a plain ``mmssl validate`` see them),
``current_model_state`` the raw ones and ``averaging_state`` the update count. A resume restores
all three and the step of the last update, so a resumed run averages exactly as an uninterrupted
one. mmssl's tools read the raw weights unless ``--ema`` (:func:`mmssl.checkpoints.read.lightning_weights`).
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any, Literal, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import WeightAveraging
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torchmetrics import Metric

from mmssl.checkpoints.read import RAW_WEIGHTS, has_averaged_weights, read_checkpoint
from mmssl.distributed import is_sharded
from mmssl.upstream import set_weight_averaging_model, weight_averaging_model

__all__ = ["EMA", "EVALUATE", "SUFFIX", "ema_decay"]

EVALUATE = ("raw", "ema", "both")
SUFFIX = "_ema"  # ``evaluate: both`` logs the averaged weights' figures under KEY + SUFFIX


def ema_decay(decay: float, step: int, warmup_power: Optional[float] = None, warmup_gamma: float = 1.0) -> float:
    """The decay of the update after optimizer step ``step`` (0-based).

    With a warm-up, timm ``ModelEmaV3.get_decay`` (after @crowsonkb):
    ``min(decay, 1 - (1 + step / warmup_gamma) ** -warmup_power)``, 0 at step 0 (a copy), so early
    averages are not dominated by the random initialisation; power 3/4 reaches 0.999 at 10k steps,
    2/3 at 31.6k.

    Args:
        decay: the decay after warm-up, in (0, 1).
        step: the optimizer step the update follows, from 0.
        warmup_power: the warm-up's power; ``None`` for none (``decay`` from the first update).
        warmup_gamma: the warm-up's inverse gamma (timm's default 1).

    Returns:
        The weight of the old average: ``ema = decay * ema + (1 - decay) * weights``.
    """
    if warmup_power is None:
        return decay
    return min(decay, 1.0 - (1.0 + step / warmup_gamma) ** -warmup_power)


class EMA(WeightAveraging):
    """Keep an EMA of the weights, checkpoint it, and validate the raw weights, the EMA or both.

    Args:
        decay: weight of the old average at each update, in (0, 1) (timm / open_clip: 0.9998,
            DINO's teacher 0.996; short runs need a smaller one: the average spans about
            ``update_every_n_steps / (1 - decay)`` steps).
        warmup_power: ramp the decay up as timm's ``ModelEmaV3`` (:func:`ema_decay`); ``None``: no
            warm-up.
        warmup_gamma: the warm-up's inverse gamma.
        update_every_n_steps: update after every n-th optimizer step (step 0, n, 2n, ...).
        evaluate: what validation (in ``fit`` and ``mmssl validate``) scores: ``"raw"``,
            ``"ema"`` (Lightning's behaviour: the averaged weights are swapped in for validation,
            and are the module's weights after ``fit``) or ``"both"``: the raw weights under the
            usual keys, then the EMA's under ``KEY_ema`` (``val/loss_ema``,
            ``val/zero_shot_top1_ema``, ``probe/linear_top1_ema``, ...), the evaluation callbacks
            (those with an ``evaluate`` method: ZeroShot, LinearProbe, KNNProbe) included.
    """

    def __init__(
        self,
        decay: float = 0.999,
        warmup_power: Optional[float] = None,
        warmup_gamma: float = 1.0,
        update_every_n_steps: int = 1,
        evaluate: Literal["raw", "ema", "both"] = "ema",
    ) -> None:
        where = "(its trainer.callbacks entry)"
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA: init_args.decay {where} must be in (0, 1), got {decay}")
        if warmup_power is not None and warmup_power <= 0:
            raise ValueError(
                f"EMA: init_args.warmup_power {where} must be > 0 (or null: no warm-up), got {warmup_power}"
            )
        if warmup_gamma <= 0:
            raise ValueError(f"EMA: init_args.warmup_gamma {where} must be > 0, got {warmup_gamma}")
        if update_every_n_steps < 1:
            raise ValueError(f"EMA: init_args.update_every_n_steps {where} must be >= 1, got {update_every_n_steps}")
        if evaluate not in EVALUATE:
            raise ValueError(f"EMA: init_args.evaluate {where} must be one of {EVALUATE}, got {evaluate!r}")
        super().__init__(use_buffers=True)  # the AveragedModel is built in setup
        self.decay, self.warmup_power, self.warmup_gamma = decay, warmup_power, warmup_gamma
        self.update_every_n_steps, self.evaluate = update_every_n_steps, evaluate
        self._decay_now = decay
        self._copied: set[int] = set()  # storage of the non-persistent buffers of the average
        self._copy: Optional[pl.LightningModule] = None  # the averaged module of ``mmssl validate``

    # ---- averaging -----------------------------------------------------------------------------

    @torch.no_grad()
    def update_average(self, averaged: list[Tensor], current: list[Tensor], num_averaged: Tensor) -> None:
        """The ``multi_avg_fn`` of the ``AveragedModel``: one EMA step at this step's decay.

        Args:
            averaged: the average's tensors of one device and dtype (updated in place).
            current: the module's matching tensors.
            num_averaged: updates so far (torch's counter; the decay here is a function of the step).
        """
        # AveragedModel groups the tensors by device and dtype: one call per group. Copied, not
        # averaged: integer buffers (BatchNorm's num_batches_tracked), as timm ModelEmaV3 does, and
        # non-persistent buffers (constants outside the checkpoint, like open_clip's causal mask
        # whose -inf would average to nan).
        pairs = [(a, c) for a, c in zip(averaged, current)
                 if (a.is_floating_point() or a.is_complex()) and a.data_ptr() not in self._copied]
        if pairs:
            get_ema_multi_avg_fn(self._decay_now)([a for a, _ in pairs], [c for _, c in pairs], num_averaged)
        if len(pairs) < len(averaged):
            kept = {id(a) for a, _ in pairs}
            for a, c in zip(averaged, current):
                if id(a) not in kept:
                    a.copy_(c)

    def should_update(self, step_idx: Optional[int] = None, epoch_idx: Optional[int] = None) -> bool:
        """After optimizer steps 0, n, 2n, ... (``update_every_n_steps``); never at epoch ends."""
        return step_idx is not None and step_idx % self.update_every_n_steps == 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # A function of the step (restored on resume), not of a count kept here.
        self._decay_now = ema_decay(self.decay, trainer.global_step - 1, self.warmup_power, self.warmup_gamma)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def averaged_module(self) -> Optional[pl.LightningModule]:
        """The module holding the averaged weights (``None`` before ``fit`` / ``validate`` set it up)."""
        average = weight_averaging_model(self)
        return average.module if average is not None else self._copy

    # ---- set-up --------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if is_sharded(trainer.strategy):
            raise ValueError(f"EMA: {type(trainer.strategy).__name__} shards the weights and WeightAveraging keeps a "
                             "whole copy on every device: use EMA with DDP or one device")
        if stage == "fit":
            # WeightAveraging.setup, without its warning about configure_model (CLIP's only acts
            # under FSDP, refused above): the layers exist before the copy is made.
            if is_overridden("configure_model", pl_module):
                pl_module.configure_model()
            average = AveragedModel(pl_module, device=pl_module.device, use_buffers=True,
                                    multi_avg_fn=self.update_average)
            set_weight_averaging_model(self, average)
            module = average.module
            persistent = set(module.state_dict())
            self._copied = {b.data_ptr() for name, b in module.named_buffers() if name not in persistent and b.numel()}
            self._attach(module, trainer, pl_module)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """``mmssl validate``: Lightning has loaded ``state_dict``, the averaged weights of an EMA
        checkpoint. ``ema`` keeps them, ``raw`` loads the raw ones, ``both`` keeps the average in a
        copy and loads the raw ones; ``ema`` / ``both`` refuse a checkpoint without an average,
        before any batch (every rank reads the same file, so all stop together)."""
        if trainer.state.fn != "validate":
            return
        path = trainer.ckpt_path
        checkpoint = read_checkpoint(str(path)) if path else {}
        if not has_averaged_weights(checkpoint):
            if self.evaluate != "raw":
                raise ValueError(f"EMA: init_args.evaluate={self.evaluate!r} needs --ckpt_path of a checkpoint "
                                 f"trained with mmssl.callbacks.EMA; {path or 'no checkpoint'}: no averaged "
                                 f"weights (no '{RAW_WEIGHTS}'): set evaluate: raw or drop the callback")
            return
        if self.evaluate == "both":
            self._copy = deepcopy(pl_module)
            self._attach(self._copy, trainer, pl_module)
        if self.evaluate != "ema":
            pl_module.load_state_dict(checkpoint[RAW_WEIGHTS])

    @staticmethod
    def _attach(module: pl.LightningModule, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Let the averaged copy run validation code: the trainer (for ``all_gather``, the
        device), eval mode, and its ``log`` writing to ``pl_module``'s keys + ``_ema``."""
        module.trainer = trainer
        module.eval()
        module.log = _SuffixedLog(pl_module)

    # ---- validation ----------------------------------------------------------------------------

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.evaluate == "ema":
            super().on_validation_epoch_start(trainer, pl_module)  # swap the average in
        module = self.averaged_module()
        if self.evaluate == "both" and module is not None and not trainer.sanity_checking:
            module.on_validation_epoch_start()

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        module = self.averaged_module()
        if self.evaluate != "both" or module is None or trainer.sanity_checking:
            return
        args = (batch, batch_idx) if len(trainer.num_val_batches) <= 1 else (batch, batch_idx, dataloader_idx)
        with trainer.precision_plugin.val_step_context():
            module.validation_step(*args)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.evaluate == "ema":
            super().on_validation_epoch_end(trainer, pl_module)  # swap the raw weights back
            return
        module = self.averaged_module()
        if self.evaluate != "both" or module is None or trainer.sanity_checking:
            return
        # The module's own epoch-end figures, then every evaluation callback's, for the average.
        # Every rank runs all of them: their reductions are collectives.
        module.on_validation_epoch_end()
        for callback in trainer.callbacks:
            if callback is not self and callable(getattr(callback, "evaluate", None)):
                callback.on_validation_epoch_end(trainer, module)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "validate":
            self._copy = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning's WeightAveraging ends ``fit`` with the averaged weights in the module; with
        # ``raw`` / ``both`` the module keeps the weights it trained (both are in the checkpoint).
        if self.evaluate == "ema":
            super().on_train_end(trainer, pl_module)


class _SuffixedLog:
    """``LightningModule.log`` of the averaged copy: ``pl_module.log(name + "_ema", ...)``.

    A torchmetrics ``Metric`` (the modules log their sum-and-count metrics as objects) is
    computed here, a reduction over ranks that every rank reaches, and reset, as Lightning does
    for the module's own; the figure is then the same on every rank, and ``sync_dist``'s mean
    leaves it as it is.
    """

    def __init__(self, pl_module: pl.LightningModule) -> None:
        self.pl_module = pl_module

    def __call__(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("metric_attribute", None)
        if isinstance(value, Metric):
            value, _ = value.compute(), value.reset()
            kwargs["sync_dist"] = True
        self.pl_module.log(f"{name}{SUFFIX}", value, *args, **kwargs)
