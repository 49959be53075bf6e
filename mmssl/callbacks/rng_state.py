"""Checkpoint every rank's random number generators, so a resumed run draws what the original would.

Lightning checkpoints the model, optimizer, schedulers, loops and callback states, but no RNG: a
resumed run continues from ``seed_everything``'s state, so FLIP/MAE masks, dropout and anything
else drawn in the training process differ from the uninterrupted run from the first resumed step.
"""

from __future__ import annotations

import random
from typing import Any, Optional

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn

# Lightning has a public ``isolate_rng`` context manager but no public collect/set pair: its
# ``_collect_rng_states``/``_set_rng_states`` are private, and return numpy's state as an ndarray
# tuple, which ``torch.load(weights_only=True)`` refuses. These two are written here with every
# state as a tensor of fixed shape, so that every rank's states can be gathered with one
# ``all_gather`` per key and the checkpoint loads under ``weights_only=True``.


def collect_rng_states(device: Optional[torch.device] = None) -> dict[str, torch.Tensor]:
    """The global RNG states of this process as tensors: torch CPU, Python, numpy, and ``device``'s.

    Args:
        device: the process's accelerator; a CUDA device adds its generator's state (only this
            one: under DDP each process draws on its own GPU, and every rank then saves the same
            keys and shapes whatever devices it can see).

    Returns:
        ``{name: tensor}``, the same names and shapes on every rank.
    """
    _, python_words, python_gauss = random.getstate()  # 624 Mersenne-Twister words + position
    _, numpy_words, numpy_pos, numpy_has_gauss, numpy_gauss = np.random.get_state()
    states = {
        "torch": torch.get_rng_state(),  # (5056,) uint8
        "python": torch.tensor(python_words, dtype=torch.int64),  # (625,)
        "python_gauss": torch.tensor([python_gauss is not None, python_gauss or 0.0], dtype=torch.float64),
        "numpy": torch.tensor([*numpy_words.tolist(), numpy_pos], dtype=torch.int64),  # (625,)
        "numpy_gauss": torch.tensor([numpy_has_gauss, numpy_gauss], dtype=torch.float64),
    }
    if device is not None and device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)  # (16,) uint8
    return states


def set_rng_states(states: dict[str, torch.Tensor], device: Optional[torch.device] = None) -> None:
    """Restore states written by :func:`collect_rng_states` (``device``'s when saved and CUDA)."""
    # clone(): a row of a stacked (world, ...) tensor is a view into shared storage, which
    # set_rng_state does not handle (it crashes the process on torch 2.x).
    torch.set_rng_state(states["torch"].cpu().clone())
    has_gauss, gauss = states["python_gauss"].tolist()
    random.setstate((3, tuple(states["python"].tolist()), gauss if has_gauss else None))
    words = states["numpy"].tolist()
    has_gauss, gauss = states["numpy_gauss"].tolist()
    np.random.set_state(("MT19937", np.array(words[:-1], dtype=np.uint32), words[-1], int(has_gauss), gauss))
    if "cuda" in states and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"].cpu().clone(), device)


def seed_all(seed: int) -> None:
    """Seed torch (CPU and CUDA), Python and numpy with ``seed`` (``0 <= seed < 2**32``)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


class RNGState(pl.Callback):
    """Save every rank's RNG states in each checkpoint; restore them on resume, rank by rank.

    States are saved when the checkpoint is dumped (every rank takes part in the gather; rank 0
    writes the file) and restored at ``on_train_start``: after the model's ``on_fit_start``, which
    reseeds per rank, so a resumed rank continues the stream it saved instead of the reseeded one.
    Resumed on another number of ranks, the saved streams cannot be matched to ranks: each rank is
    then reseeded from (the current seed, global step, rank), with a warning.

    Validation inside ``fit`` runs with the training RNG set aside and put back afterwards (as
    Lightning does for its sanity check), so validation code never shifts the training stream: a
    run resumed from a checkpoint written before a validation, which the resumed run does not
    repeat, draws the same masks as the run that validated. This needs loaders that leave the
    global torch RNG alone: a ``DataLoader`` without its own ``generator`` draws its worker seed
    from it whenever an iterator is created, before any hook runs (mmssl's loaders have one).
    """

    def __init__(self) -> None:
        self._trainer: Optional[pl.Trainer] = None
        self._loaded: Optional[dict[str, torch.Tensor]] = None
        self._before_validation: Optional[dict[str, torch.Tensor]] = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer  # state_dict() gets no trainer, and must gather over ranks

    def state_dict(self) -> dict[str, Any]:
        """Every rank's states, stacked on a leading rank dimension: ``{name: (world, ...)}``.

        Runs on every rank while the checkpoint is dumped (the gathers are collectives)."""
        trainer = self._trainer
        states = collect_rng_states(trainer.strategy.root_device if trainer is not None else None)
        if trainer is None or trainer.world_size == 1:
            return {name: state.unsqueeze(0) for name, state in states.items()}
        device = trainer.strategy.root_device
        return {name: trainer.strategy.all_gather(state.to(device)).cpu() for name, state in sorted(states.items())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = dict(state_dict)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._loaded is None:
            return
        saved, self._loaded = self._loaded, None
        saved_world = saved["torch"].shape[0]
        if saved_world == trainer.world_size:
            set_rng_states({name: state[trainer.global_rank] for name, state in saved.items()},
                           trainer.strategy.root_device)
            return
        # str seeds hash with SHA-512: stable across runs and processes.
        seed = random.Random(f"{torch.initial_seed()}/{trainer.global_step}/{trainer.global_rank}").getrandbits(32)
        seed_all(seed)
        rank_zero_warn(
            f"RNGState: the checkpoint holds the random states of {saved_world} ranks, this run has "
            f"{trainer.world_size}; each rank is reseeded from (seed, step {trainer.global_step}, rank) "
            "instead, so random draws (masks, dropout, augmentation in this process) differ from an "
            "uninterrupted run from here on."
        )

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            self._before_validation = collect_rng_states(trainer.strategy.root_device)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._before_validation is not None:
            set_rng_states(self._before_validation, trainer.strategy.root_device)
            self._before_validation = None
