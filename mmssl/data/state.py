"""Where the training stream stands, and the loader that starts each epoch from it.

The stream of each worker is a deterministic function of (seed, epoch, rank, worker)
(:mod:`mmssl.data.pipeline`). The position is then a few integers per worker: the batches it has
served this epoch and the raw samples it consumed for them. A resumed worker re-reads its shards
and drops that many raw samples *before decoding* (cheap: tar reads only), then continues.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

from torch.utils.data import DataLoader

from mmssl.data.pipeline import ShardStream


class StreamPosition:
    """The checkpointed position of one rank's training stream.

    Attributes:
        epoch: epoch the counters refer to (-1 before the first).
        batches: per worker, batches handed to the model this epoch.
        raw: per worker, raw samples consumed for those batches.
        skipped: bad samples and unreadable shard parts skipped so far in the run (this rank).
    """

    def __init__(self) -> None:
        self.epoch = -1
        self.batches: list[int] = []
        self.raw: list[int] = []
        self.skipped = 0

    def start(self, epoch: int, workers: int, epoch_batches: int) -> tuple[int, dict[int, tuple[int, int]]]:
        """Begin iterating ``epoch``: continue it if the position is inside it, else start afresh.

        Args:
            epoch: epoch about to be read.
            workers: loader workers.
            epoch_batches: batches in a full epoch.

        Returns:
            ``(rotation, resume)`` for :meth:`ShardStream.set_position`.
        """
        served = sum(self.batches)
        if epoch == self.epoch and len(self.batches) == workers and 0 < served < epoch_batches:
            # Batches went round-robin from worker 0, so the next one is worker served % workers.
            return served % workers, {w: (self.batches[w], self.raw[w]) for w in range(workers)}
        self.epoch, self.batches, self.raw = epoch, [0] * workers, [0] * workers
        return 0, {}

    def update(self, worker: int, raw: int, skipped: int) -> None:
        """Record one batch handed to the model."""
        self.batches[worker] += 1
        self.raw[worker] = raw
        self.skipped += skipped

    def state_dict(self, raw_per_rank: Optional[list[list[int]]] = None) -> dict[str, Any]:
        """The position; ``raw_per_rank`` holds every rank's ``raw`` (all ranks in lockstep share
        ``epoch`` and ``batches``), defaulting to this rank's alone."""
        return {"epoch": self.epoch, "batches": list(self.batches),
                "raw": raw_per_rank if raw_per_rank is not None else [list(self.raw)],
                "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any], rank: int = 0) -> None:
        """Restore; a checkpoint from another number of ranks restarts the epoch, with a warning."""
        self.skipped = int(state.get("skipped", 0))
        raw = state.get("raw", [])
        if rank >= len(raw) or len(raw[rank]) != len(state.get("batches", [])):
            warnings.warn(f"data position saved with {len(raw)} ranks cannot continue on rank {rank}: "
                          f"the data stream restarts epoch {state.get('epoch')} from its beginning")
            self.epoch, self.batches, self.raw = -1, [], []
            return
        self.epoch, self.batches, self.raw = int(state["epoch"]), list(state["batches"]), list(raw[rank])


class EpochLoader(DataLoader):
    """A DataLoader that tells its :class:`ShardStream` the epoch (and resume point) at each ``iter``.

    Workers are not persistent: they are started per epoch and receive the stream with its epoch
    set, which makes the epoch explicit (no counter hidden in worker copies, which only advanced
    while workers persisted). Forked worker start-up costs well under a second per epoch.

    Args:
        dataset: the stream.
        epoch_fn: returns the epoch about to start (the trainer's ``current_epoch``); ``None``
            counts calls to ``iter``.
        position: the training position to start from and track; ``None`` for validation.
        **kwargs: DataLoader arguments (``num_workers``, ``pin_memory``...).
    """

    def __init__(
        self,
        dataset: ShardStream,
        epoch_fn: Optional[Callable[[], Optional[int]]] = None,
        position: Optional[StreamPosition] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(dataset, batch_size=None, persistent_workers=False, **kwargs)
        self.epoch_fn, self.position, self._calls = epoch_fn, position, 0

    def __iter__(self):
        epoch = self.epoch_fn() if self.epoch_fn is not None else None
        epoch = self._calls if epoch is None else epoch
        self._calls += 1
        rotation, resume = 0, {}
        if self.position is not None:
            rotation, resume = self.position.start(epoch, self.dataset.spec.workers, len(self.dataset))
        self.dataset.set_position(epoch, rotation, resume)
        return super().__iter__()

    # Lightning warns that a loader without these cannot resume mid-epoch; the position is
    # checkpointed by ImageTextDataModule.state_dict (with every rank's part), so the loader's
    # own state is empty.
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
