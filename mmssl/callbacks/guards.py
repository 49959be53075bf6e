"""Guards for long runs: skip steps whose gradients are not finite, stop after too many in a row;
keep DDP's buffer broadcast out of evaluation, where ranks run unequal numbers of batches.

Lightning's ``detect_anomaly`` only raises, and GradScaler's skip exists only for fp16; bf16 and
fp32 runs need the same protection, so it is written here as a small callback.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from mmssl.log_cadence import logging_step
from mmssl.upstream import (
    clear_found_inf,
    ddp_buffer_sync_state,
    set_ddp_buffer_sync_state,
    set_found_inf,
    takes_found_inf,
)


class NonFiniteGuard(pl.Callback):
    """Skip optimizer steps with a non-finite gradient; stop after ``max_consecutive`` in a row.

    The decision is reduced across ranks (any rank non-finite -> every rank skips), so DDP ranks
    stay identical. A skipped step leaves parameters and optimizer state untouched; the count is
    logged as ``train/nonfinite_skipped``.

    Two ways to skip, picked per optimizer:

    - **Sync-free** (fused ``Adam``/``AdamW``, ``fused=True``, no fp16 ``GradScaler``): the
      non-finite flag stays on the device, is all-reduced (MAX) across ranks without a host read,
      and is handed to the optimizer as its ``found_inf``, the input ``GradScaler`` uses: the fused
      kernel then leaves parameters and moments alone and torch takes the step count back
      (``torch/optim/adam.py``, ``_fused_adam``; a skipped first step leaves Adam's freshly made
      state: zero moments, step 0). The counts accumulate on the device; the host reads them every
      ``every_n_steps`` steps (default: Lightning's logging steps) and at the end of
      training, where it also checks the limit, and when a checkpoint is saved (counts only). On a
      GPU, where a host read is a device sync, the loop never waits for the GPU in between; a run
      of ``max_consecutive`` skipped steps stops training at the next check, up to
      ``every_n_steps - 1`` steps late (steps that are skipped too: no weight is harmed).
    - **Synchronous** (any other optimizer, or fp16 with a ``GradScaler``, which sets
      ``found_inf`` itself): the flag is read every step and every ``.grad`` of a bad step is
      dropped, so the optimizer passes over every parameter; the stop is immediate.

    Args:
        max_consecutive: consecutive skipped steps after which training stops with an error.
        every_n_steps: optimizer steps between host reads of the counts on the sync-free
            path; ``None``: on the steps whose metrics Lightning logs (``log_every_n_steps``).
    """

    # The cadence key of EmbeddingHealth and Reconstructions; configs saved earlier keep loading (mmssl.renames).
    renamed_args = {"check_every_n_steps": "every_n_steps"}

    def __init__(self, max_consecutive: int = 5, every_n_steps: Optional[int] = None) -> None:
        if max_consecutive < 1:
            raise ValueError(f"--nonfinite_guard.max_consecutive must be >= 1, got {max_consecutive}")
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"--nonfinite_guard.every_n_steps must be >= 1 or null, got {every_n_steps}")
        self.max_consecutive = max_consecutive
        self.every_n_steps = every_n_steps
        self.skipped = 0  # exact as of the last host read
        self.consecutive = 0
        self.host_reads = 0  # reads of the device counts (each one a device sync on a GPU)
        # Sync-free path, on the flag's device: skipped since the last read, the current run of
        # skipped steps, the longest run since the last read. Four tiny ops a step (~0.3 ms on
        # this CPU, a few launches on a GPU) keep them, against a host read of the flag.
        self._counts: Optional[tuple[Tensor, Tensor, Tensor]] = None
        self._armed: list[torch.optim.Optimizer] = []

    @staticmethod
    def sync_free(trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s step can take the skip decision as a device tensor.

        Only fused Adam/AdamW: their fused step takes back the step count of a skipped step. Fused
        SGD does not qualify: on its first step it allocates momentum buffers the skipped kernel
        never fills (torch ``_fused_sgd``, ``is_first_step``)."""
        return (
            isinstance(optimizer, torch.optim.Adam)  # AdamW included (a subclass)
            and takes_found_inf(optimizer)
            and all(group.get("fused") for group in optimizer.param_groups)
            and getattr(trainer.precision_plugin, "scaler", None) is None
        )

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        # One fused norm over all gradients (~2 ms for 8M parameters on CPU, against ~17 ms for a
        # per-tensor isfinite): a NaN or inf anywhere makes the total norm non-finite.
        if grads:
            norm = torch.nn.utils.get_total_norm(grads)
            # FSDP2's gradients are DTensor shards: their norm is a partial sum until reduced.
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            bad = (~torch.isfinite(norm)).float()
        else:  # a rank without gradients still joins the reduction
            bad = torch.zeros((), device=pl_module.device)
        if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            # Written out rather than `trainer.strategy.reduce`: Lightning's `_sync_ddp` puts a
            # barrier (a host wait) before every all-reduce. MAX: any rank bad -> every rank skips.
            torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        if self.sync_free(trainer, optimizer):
            self._record(bad)
            set_found_inf(optimizer, bad)  # read by the fused step (torch.optim.Adam.step)
            self._armed.append(optimizer)
            every = self.every_n_steps
            if logging_step(trainer) if every is None else (trainer.global_step + 1) % every == 0:
                self._read(trainer, pl_module)
            return
        # Synchronous path: a host read every step (free on a CPU, a device sync on a GPU).
        if not bool(bad):
            self.consecutive = 0
            return
        self.skipped += 1
        self.consecutive += 1
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
        pl_module.log("train/nonfinite_skipped", float(self.skipped), rank_zero_only=True)
        self._stop_if(self.consecutive, trainer)

    def _record(self, bad: Tensor) -> None:
        if self._counts is None or self._counts[0].device != bad.device:
            self._pull()
            self._counts = (torch.zeros((), device=bad.device), torch.zeros((), device=bad.device),
                            torch.zeros((), device=bad.device))
        new, run, longest = self._counts
        new.add_(bad)
        run.add_(1).mul_(bad)  # the run grows on a bad step, restarts at 0 on a good one
        torch.maximum(longest, run, out=longest)

    def _pull(self, new_window: bool = True) -> float:
        """Add the device counts to the host's (the guard's only host wait on the sync-free path);
        return the longest run of skipped steps since the last read that checked it
        (``new_window``: this one checks it, so the next window starts from the current run)."""
        if self._counts is None:
            return 0.0
        self.host_reads += 1
        new, run, longest = self._counts
        values = torch.stack(self._counts).tolist()
        new.zero_()
        if new_window:
            longest.copy_(run)  # a run in progress carries over into the next window
        self.skipped += int(values[0])
        self.consecutive = int(values[1])
        return values[2]

    def _read(self, trainer: pl.Trainer, pl_module: Optional[pl.LightningModule]) -> None:
        longest = self._pull()
        if pl_module is not None and self.skipped:
            pl_module.log("train/nonfinite_skipped", float(self.skipped), rank_zero_only=True)
        self._stop_if(int(longest), trainer)

    def _stop_if(self, run: int, trainer: pl.Trainer) -> None:
        if run >= self.max_consecutive:
            raise RuntimeError(
                f"NonFiniteGuard: the loss or gradients were NaN/inf for {run} steps in a row (the limit "
                f"is {self.max_consecutive}; step {trainer.global_step}, {self.skipped} skipped in all). "
                "Lower the learning rate, raise warm-up, or check the data; the last good checkpoint is "
                "untouched."
            )

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        # Disarm after the step, so a later step that skips this hook never sees a stale flag.
        for optimizer in self._armed:
            clear_found_inf(optimizer)
        self._armed.clear()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._read(trainer, None)  # `log` is not allowed here; the counts and the stop still are

    def state_dict(self) -> dict[str, Any]:
        self._pull(new_window=False)  # exact counts in every checkpoint; the stop check is left to the next read
        return {"skipped": self.skipped, "consecutive": self.consecutive}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped = state_dict["skipped"]
        self.consecutive = state_dict["consecutive"]
        self._counts = None


class EvaluationBufferSync(pl.Callback):
    """Keep DDP's buffer broadcast out of validation inside ``fit``, and leave DDP as it was found.

    During ``fit`` Lightning runs ``validation_step`` through the DDP wrapper, whose forward
    broadcasts the module's buffers from rank 0 (``broadcast_buffers=True``, DDP's default) when
    its ``require_forward_param_sync`` flag is set: on the first forward after a training step,
    and on the very first one (the sanity check). That is a collective inside the forward of the
    ranks that have a validation batch; a rank whose share of the validation shards is empty
    never joins it and the others wait forever (the demo's one validation shard on 2 ranks hung
    this way). Each forward also rewrites the flag, so ranks that ran different numbers of
    validation forwards would enter the next training step disagreeing on whether to broadcast:
    the same hang, one step later. So validation runs with the broadcast off (evaluation changes
    no buffer) and the flag is put back as it was, equal on every rank, for training.
    """

    def __init__(self) -> None:
        self._saved: tuple[DistributedDataParallel, tuple[bool, bool]] | None = None

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = trainer.strategy.model
        if isinstance(model, DistributedDataParallel):
            # Both flags are read by DDP at every forward (torch ``_pre_forward``).
            state = ddp_buffer_sync_state(model)
            self._saved = (model, state)
            set_ddp_buffer_sync_state(model, (False, state[1]))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._saved is not None:
            model, state = self._saved
            set_ddp_buffer_sync_state(model, state)
            self._saved = None
