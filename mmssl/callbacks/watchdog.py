"""The rank watchdog of every run (:mod:`mmssl.watchdog`): a hang names the late rank and leaves
every process's stacks in ``<run>/hang``; a rank that fails takes the others down within seconds."""

from __future__ import annotations

import functools
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed
from lightning.pytorch.utilities import rank_zero_warn

from mmssl.watchdog import BETWEEN, RankWatchdog, hang_timeout_s

COLLECTIVES = ("barrier", "broadcast", "reduce", "all_gather")
# torch.distributed's, called by Lightning's metric syncing and mmssl's guards and gathers (DDP's
# own, in C++, fall in the step's "working on a batch").
TORCH_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
                     "broadcast_object_list", "barrier", "reduce", "reduce_scatter_tensor", "gather", "scatter")


def pg_timeout_s(strategy: Any) -> Optional[float]:
    """The process-group timeout a Lightning strategy was given (DDP, FSDP, ModelParallel keep it
    as ``_timeout``); ``None`` for a strategy without one."""
    timeout = getattr(strategy, "_timeout", None)
    return timeout.total_seconds() if hasattr(timeout, "total_seconds") else None


class Watchdog(pl.Callback):
    """Arms :class:`mmssl.watchdog.RankWatchdog` for the fit (or validate, test) of each rank.

    Args:
        timeout_s: seconds a rank may wait for a batch, or in a collective, or work on one batch
            (with more than one rank) before every rank writes its stacks and the run ends; unset:
            ``$MMSSL_HANG_TIMEOUT_S``, else 90% of the process-group timeout, else 30 min.
        poll_s: how often each rank's watchdog looks (markers, its own phase).
    """

    def __init__(self, timeout_s: Optional[float] = None, poll_s: float = 1.0) -> None:
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"watchdog.timeout_s must be > 0 seconds or null, got {timeout_s}")
        if not poll_s > 0:
            raise ValueError(f"watchdog.poll_s must be > 0 seconds, got {poll_s}")
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self._dog: Optional[RankWatchdog] = None
        self._torch: dict[str, Any] = {}  # torch.distributed's functions, while wrapped

    def _new(self, trainer: pl.Trainer) -> RankWatchdog:
        timeout = self.timeout_s or hang_timeout_s(pg_timeout_s(trainer.strategy))
        return RankWatchdog(trainer.default_root_dir, trainer.global_rank, trainer.world_size, timeout, self.poll_s)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._dog is not None:
            return
        try:
            self._dog = self._new(trainer).start()
        except OSError as err:  # a run folder it cannot write: the run goes on without it
            rank_zero_warn(f"mmssl: no rank watchdog (hangs are not reported, a failed rank does not end the "
                           f"others): {err}")
            return
        strategy = trainer.strategy
        for name in COLLECTIVES:
            method = getattr(strategy, name, None)
            if method is not None:
                setattr(strategy, name, _in_phase(self._dog, f"in a collective (strategy.{name})", method))
        if trainer.world_size > 1 and not self._torch:
            for name in TORCH_COLLECTIVES:
                function = getattr(torch.distributed, name, None)
                if function is not None:
                    self._torch[name] = function
                    setattr(torch.distributed, name, _in_phase(self._dog, f"in a collective (torch.distributed.{name})",
                                                               function))

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self._dog is not None:
            self._dog.enter(BETWEEN, timed=False)

    on_validation_batch_end = on_train_batch_end

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if trainer.world_size > 1:
            try:
                (self._dog or self._new(trainer)).failed(exception)
            except OSError:  # the run's own error matters more (a full disk is often both)
                pass
        self._disarm(trainer)  # Lightning calls no teardown hook after an exception

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._disarm(trainer)

    def _disarm(self, trainer: pl.Trainer) -> None:
        for name in COLLECTIVES:
            trainer.strategy.__dict__.pop(name, None)  # the class's method again
        for name, function in self._torch.items():
            setattr(torch.distributed, name, function)
        self._torch = {}
        if self._dog is not None:
            self._dog.stop()
            self._dog = None


def _in_phase(dog: RankWatchdog, where: str, method: Any) -> Any:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # traced: no phase (a constant branch for dynamo)
            return method(*args, **kwargs)
        with dog.phase(where):
            return method(*args, **kwargs)

    return call
