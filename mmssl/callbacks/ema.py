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
attention mask, whose ``-inf`` entries would average to ``nan``). Under DDP each rank
updates its own copy from the same (DDP-synchronised) weights, so the copies agree on every rank.
Under FSDP2 the copy is made before the model is sharded and sharded by the model's own
``configure_model``: each rank keeps and updates only its shards (the update is elementwise, so
the numbers are those of whole tensors), and nothing is gathered per step.

Checkpoints follow ``WeightAveraging``'s convention: ``state_dict`` holds the **averaged** weights
(so Lightning's ``load_from_checkpoint`` sees them),
``current_model_state`` the raw ones and ``averaging_state`` the update count (an FSDP2 folder:
``state_dict`` the raw weights, ``averaged_state_dict`` the average, see
:mod:`mmssl.checkpoints.sharded`). A resume restores all three and the step of the last update, so
a resumed run averages exactly as an uninterrupted one; the model always resumes from the raw
weights (:func:`mmssl.checkpoints.sharded.raw_first`), as ``mmssl validate`` without this callback
does. mmssl's tools read the raw weights unless ``--ema``
(:func:`mmssl.checkpoints.read.lightning_weights`).
"""

from __future__ import annotations

import itertools
import os
import types
from copy import deepcopy
from typing import Any, Iterator, Literal, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import WeightAveraging
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torchmetrics import Metric

from mmssl.checkpoints.read import AVERAGING_STATE, LIGHTNING_META, RAW_WEIGHTS, has_averaged_weights, read_checkpoint
from mmssl.checkpoints.sharded import (
    AVERAGED_WEIGHTS,
    checkpoint_folder,
    gather_module,
    load_averaged_weights,
    load_full_state,
    reshard_module,
)
from mmssl.distributed import is_sharded
from mmssl.sharding import is_fsdp2
from mmssl.upstream import fsdp2_lazy_init, set_averaged_module, set_weight_averaging_model, weight_averaging_model

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
        self._swapped: list[tuple[Tensor, Tensor]] = []  # FSDP2, evaluate: ema: (average, model) tensors
        self._gathered = False  # FSDP2, evaluate: both: the average is gathered for evaluation

    # ---- averaging -----------------------------------------------------------------------------

    @torch.no_grad()
    def update_average(self, averaged: list[Tensor], current: list[Tensor], num_averaged: Tensor) -> None:
        """The ``multi_avg_fn`` of the ``AveragedModel``: one EMA step at this step's decay.

        Args:
            averaged: the average's tensors of one device and dtype (updated in place).
            current: the module's matching tensors.
            num_averaged: updates so far (torch's counter; the decay here is a function of the step).
        """
        # FSDP2: each rank averages its own shards, the local tensors of the DTensors (an
        # elementwise update, so the same numbers as on the whole tensors).
        averaged, current = [_local(a) for a in averaged], [_local(c) for c in current]
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

    def _swap_models(self, pl_module: pl.LightningModule) -> None:
        """WeightAveraging's swap of the average and the model, their tensors paired by name (:func:`_pairs`)."""
        _exchange(_pairs(weight_averaging_model(self).module, pl_module))

    @torch.no_grad()
    def _copy_average_to_current(self, pl_module: pl.LightningModule) -> None:
        """WeightAveraging's end of ``fit``: the averaged weights into the model, paired by name."""
        for a, c in _pairs(weight_averaging_model(self).module, pl_module):
            _local(c).copy_(_local(a))

    def averaged_module(self) -> Optional[pl.LightningModule]:
        """The module holding the averaged weights (``None`` before ``fit`` / ``validate`` set it up)."""
        average = weight_averaging_model(self)
        return average.module if average is not None else self._copy

    # ---- set-up --------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        fsdp2 = isinstance(trainer.strategy, ModelParallelStrategy)
        if is_sharded(trainer.strategy) and not fsdp2:
            raise ValueError(f"EMA: {type(trainer.strategy).__name__} (FSDP 1) shards the weights and WeightAveraging "
                             "keeps a whole copy on every device: use EMA with FSDP2 (configs/trainer/fsdp2.yaml), "
                             "DDP or one device")
        if fsdp2 and is_fsdp2(pl_module):
            raise ValueError(f"EMA: {type(pl_module).__name__} was sharded before the EMA callback's setup: the "
                             "average is copied from the unsharded model and sharded as it is")
        if stage == "fit":
            # WeightAveraging.setup, without its warning about configure_model: the layers exist
            # before the copy is made. Under FSDP2 the copy is made before the model is sharded,
            # then both are sharded alike (the model's configure_model on each), so each rank holds
            # and averages its shard of the average only; the whole copy exists only here.
            if not fsdp2 and is_overridden("configure_model", pl_module):
                pl_module.configure_model()
            # AveragedModel's own deepcopy would copy the device mesh and LightningCLI's optimizer
            # factory (both hold locks): the copy is made by _copy and given to it.
            average = _AveragedByName(nn.Identity(), device=pl_module.device, use_buffers=True,
                                      multi_avg_fn=self.update_average)
            set_averaged_module(average, _copy(pl_module, trainer).to(pl_module.device))
            set_weight_averaging_model(self, average)
            self._prepare(average.module, trainer, pl_module)
        elif stage == "validate" and fsdp2 and self.evaluate == "both":
            self._copy = _copy(pl_module, trainer)  # sharded below; the average is loaded in on_validation_start
            self._prepare(self._copy, trainer, pl_module)

    def _prepare(self, module: pl.LightningModule, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Shard the copy ``module`` as ``pl_module`` under FSDP2 (then ``pl_module`` itself), note
        its non-persistent buffers (copied, not averaged) and attach it for validation."""
        if isinstance(trainer.strategy, ModelParallelStrategy):
            module.trainer = trainer  # its configure_model shards it on the run's device mesh
            module.configure_model()
            fsdp2_lazy_init(module)  # it never trains: evaluation may enter an inner block first
            pl_module.configure_model()
        persistent = set(module.state_dict())
        self._copied = {b.data_ptr() for name, b in module.named_buffers() if name not in persistent and b.numel()}
        self._attach(module, trainer, pl_module)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """``fit`` under FSDP2: the average is swapped in (``ema``) or gathered (``both``) here,
        before the strategy gathers the model for evaluation (Lightning calls the callbacks' hook
        first), while both are sharded alike. ``mmssl validate``: see :meth:`_validate_checkpoint`."""
        if trainer.state.fn == "validate":
            self._validate_checkpoint(trainer, pl_module)
        module = self.averaged_module()
        if not isinstance(trainer.strategy, ModelParallelStrategy) or module is None:
            return
        if self.evaluate == "ema" and trainer.state.fn != "validate":
            self._swapped = _pairs(module, pl_module)  # the sharded tensors, still named after the gather
            _exchange(self._swapped)
        elif self.evaluate == "both" and not trainer.sanity_checking and _gathers(trainer):
            gather_module(module)
            self._gathered = True

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._swapped:
            _exchange(self._swapped)
            self._swapped = []
        module = self.averaged_module()
        if self._gathered and module is not None:
            policy = getattr(trainer.strategy, "policy", None)
            reshard_module(module, policy.reshard_after_forward if policy is not None else True)
        self._gathered = False
        if trainer.state.fn == "validate":
            self._copy = None

    def _validate_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """``mmssl validate``: ``ema`` loads the checkpoint's averaged weights, ``raw`` its raw ones,
        ``both`` the average into a copy and the raw weights into the module, whichever the
        strategy loaded; ``ema`` / ``both`` refuse a checkpoint without an average, before any
        batch (every rank reads the same checkpoint, so all stop together). A folder is read
        shard by shard under FSDP2."""
        path = str(trainer.ckpt_path) if trainer.ckpt_path else None
        folder = path if path and isinstance(trainer.strategy, ModelParallelStrategy) and os.path.isdir(path) else None
        checkpoint = read_checkpoint(os.path.join(folder, LIGHTNING_META)) if folder else (
            read_checkpoint(path) if path else {})
        if not (AVERAGING_STATE in checkpoint if folder else has_averaged_weights(checkpoint)):
            if self.evaluate != "raw":
                raise ValueError(f"EMA: init_args.evaluate={self.evaluate!r} needs --ckpt_path of a checkpoint "
                                 f"trained with mmssl.callbacks.EMA; {path or 'no checkpoint'}: no averaged "
                                 f"weights (no '{RAW_WEIGHTS}'): set evaluate: raw or drop the callback")
            return
        strict = pl_module.strict_loading
        if self.evaluate == "both":
            if self._copy is None:
                self._copy = _copy(pl_module, trainer)
                self._attach(self._copy, trainer, pl_module)
            _load(self._copy, folder, checkpoint.get("state_dict"), strict)
        if folder:  # the model holds the folder's raw weights (its state_dict)
            if self.evaluate == "ema":
                _load(pl_module, folder, None, strict)
        else:
            _load(pl_module, None, checkpoint["state_dict" if self.evaluate == "ema" else RAW_WEIGHTS], strict)

    @staticmethod
    def _attach(module: pl.LightningModule, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Let the averaged copy run validation code: the trainer (for ``all_gather``, the
        device), eval mode, and its ``log`` writing to ``pl_module``'s keys + ``_ema``."""
        module.trainer = trainer
        module.eval()
        module.log = _SuffixedLog(pl_module)

    # ---- validation ----------------------------------------------------------------------------

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.evaluate == "ema" and not isinstance(trainer.strategy, ModelParallelStrategy):
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
            if not isinstance(trainer.strategy, ModelParallelStrategy):
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

    # ---- checkpoints -----------------------------------------------------------------------------

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        """WeightAveraging's layout. Under FSDP2 the average's entries are DTensors, written to the
        checkpoint folder shard by shard beside the raw weights; a full-state file
        (``save_distributed_checkpoint: false``) gets them whole, gathered as the raw ones are."""
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        average = weight_averaging_model(self)
        if average is None or not isinstance(trainer.strategy, ModelParallelStrategy) or \
                getattr(trainer.strategy, "sharded_checkpoints", True):
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        checkpoint["state_dict"] = get_model_state_dict(
            average.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        """Restore the average (the model holds the raw weights by now, see
        :func:`mmssl.checkpoints.sharded.raw_first`): from the checkpoint's averaged weights, or
        a folder's shards (resharded to this run's ranks), with the update count.

        A LoRA checkpoint's average holds the adapters only (the LoRA hook keeps what trains):
        the frozen base and the buffers it lacks are the raw weights' (the average of a frozen
        tensor is that tensor), never a missing-keys error. Anything else missing, or an unknown
        key, is refused naming the checkpoint.
        """
        average = weight_averaging_model(self)
        if average is None:
            super().on_load_checkpoint(trainer, pl_module, checkpoint)  # Lightning's warning outside fit
            return
        path = trainer.ckpt_path
        folder = checkpoint_folder(checkpoint)
        if AVERAGED_WEIGHTS in checkpoint:  # a file, laid out by raw_first
            averaged = checkpoint[AVERAGED_WEIGHTS]
        elif has_averaged_weights(checkpoint):  # WeightAveraging's layout (a CheckpointIO of the config's own)
            averaged = checkpoint["state_dict"]
            _load(pl_module, None, checkpoint[RAW_WEIGHTS], pl_module.strict_loading)
        elif folder is not None and AVERAGING_STATE in checkpoint:
            averaged = None  # in the folder, loaded shard by shard
        elif AVERAGING_STATE in checkpoint:
            raise ValueError(f"EMA: {path} holds an EMA ('{AVERAGING_STATE}'), but its averaged weights were not "
                             "read (a sharded checkpoint folder consolidated without them): resume it under FSDP2, "
                             "or read it with a reader that keeps its 'averaged_state_dict'")
        else:
            rank_zero_warn(f"EMA: {path} was not written with an EMA: the average starts from its weights")
            with torch.no_grad():
                for a, c in _pairs(average.module, pl_module):
                    _local(a).copy_(_local(c))
            return
        _load(average.module, folder, averaged, strict=pl_module.strict_loading, fill_from=pl_module,
              where=str(path))
        average.n_averaged.copy_(checkpoint[AVERAGING_STATE]["n_averaged"])

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning's WeightAveraging ends ``fit`` with the averaged weights in the module; with
        # ``raw`` / ``both`` the module keeps the weights it trained (both are in the checkpoint).
        if self.evaluate != "ema":
            return
        average = weight_averaging_model(self)
        if not isinstance(trainer.strategy, ModelParallelStrategy) or average is None:
            super().on_train_end(trainer, pl_module)
            return
        # FSDP2: shard by shard, the model resharded first (its root may hold gathered parameters
        # after the last step).
        reshard_module(pl_module, getattr(getattr(trainer.strategy, "policy", None), "reshard_after_forward", True))
        with torch.no_grad():
            for a, c in _pairs(average.module, pl_module):
                _local(c).copy_(_local(a))


def _copy(module: pl.LightningModule, trainer: pl.Trainer) -> pl.LightningModule:
    """A deep copy of ``module`` for the average, sharing its trainer (a module attached to one
    refers to it: a copy of the trainer would copy its loops, their live data-loader iterators and
    the run's watchdog), its device mesh (process groups are not copied) and its callables that
    are no modules (LightningCLI's optimizer and scheduler factories hold locks; the copy never
    builds an optimizer)."""
    shared: dict[int, Any] = {id(trainer): trainer}
    mesh = module.device_mesh
    if mesh is not None:
        shared[id(mesh)] = mesh
    for sub in module.modules():
        for value in vars(sub).values():
            if callable(value) and not isinstance(value, (nn.Module, Tensor)):
                shared[id(value)] = value
    return deepcopy(module, shared)


def _local(tensor: Tensor) -> Tensor:
    """The local shard of an FSDP2 DTensor (a view: writing it writes the parameter), else ``tensor``."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _named(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    return itertools.chain(module.named_parameters(), module.named_buffers())


def _pairs(average: nn.Module, model: nn.Module) -> list[tuple[Tensor, Tensor]]:
    """The average's parameters and buffers beside the model's of the same name, in the average's order.

    By name, not by position as torch's ``AveragedModel`` and Lightning's ``WeightAveraging`` pair
    them: a module may re-register a parameter after it is built, which moves it in its module's
    order (peft >= 0.22's LoRA on ``nn.MultiheadAttention`` re-registers ``in_proj_weight`` at every
    forward), and pairing by position then averages one tensor into another.
    """
    theirs = dict(_named(model))
    pairs = []
    for name, tensor in _named(average):
        if name not in theirs:
            raise ValueError(f"EMA: the model has no tensor {name!r} that its average has")
        pairs.append((tensor, theirs[name]))
    return pairs


class _AveragedByName(AveragedModel):
    """torch's ``AveragedModel`` whose update pairs the model's tensors with the average's by name
    (:func:`_pairs`); the averaging itself (``multi_avg_fn``, the first copy, the count) is torch's."""

    def update_parameters(self, model: nn.Module) -> None:
        theirs = [c for _, c in _pairs(self.module, model)]  # in the average's order: parameters, then buffers
        split = sum(1 for _ in self.module.parameters())
        in_order = types.SimpleNamespace(parameters=lambda: iter(theirs[:split]), buffers=lambda: iter(theirs[split:]))
        super().update_parameters(in_order)


@torch.no_grad()
def _exchange(pairs: list[tuple[Tensor, Tensor]]) -> None:
    """Swap the values of each pair in place (WeightAveraging's ``_swap_models``), shard by shard."""
    for a, c in pairs:
        a, c = _local(a), _local(c)
        kept = a.clone()
        a.copy_(c)
        c.copy_(kept)


def _gathers(trainer: pl.Trainer) -> bool:
    """Whether the FSDP2 strategy gathers the model for evaluation (the average follows it)."""
    return bool(getattr(trainer.strategy, "gather_for_evaluation", False))


def _load(module: nn.Module, folder: Optional[str], state: Optional[dict[str, Tensor]], strict: bool,
          fill_from: Optional[nn.Module] = None, where: str = "the checkpoint") -> None:
    """Load weights into ``module``: an averaged-weights entry of the checkpoint folder ``folder``
    (FSDP2, shard by shard), else ``state`` (whole tensors, scattered into a sharded module).

    ``strict=False`` (a LoRA model's ``strict_loading``) lets ``state`` lack frozen parameters and
    buffers, taken from ``fill_from`` when given; any other missing or unknown key is refused.
    """
    if folder is not None:
        load_averaged_weights(folder, module)
        return
    assert state is not None
    if is_fsdp2(module):
        load_full_state(module, state, strict=strict)
        return
    result = module.load_state_dict(state, strict=strict)
    frozen = {n for n, p in module.named_parameters() if not p.requires_grad} | {n for n, _ in module.named_buffers()}
    missing = [k for k in result.missing_keys if k not in frozen]
    if result.unexpected_keys or missing:
        raise KeyError(f"EMA: {where}: the averaged weights do not fit the model: missing {missing[:3]}, "
                       f"unknown {result.unexpected_keys[:3]}")
    if fill_from is not None and result.missing_keys:
        own = fill_from.state_dict()
        module.load_state_dict({k: own[k] for k in result.missing_keys}, strict=False)


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
