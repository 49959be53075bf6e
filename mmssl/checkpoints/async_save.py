"""Sharded checkpoint folders written in the background, behind the same atomic folder promise.

``FSDP2Strategy(async_mode="async")`` (:mod:`mmssl.checkpoints.sharded`) saves through
:class:`AsyncSaves`: the training step waits only for the state to be staged (copied, by
``torch.distributed.checkpoint.async_save``'s default stager, into memory of its own); a
background thread writes the copy to the hidden ``.partial`` folder, then every rank agrees on
the outcome and only then does rank 0 write ``meta.pt`` and rename the folder into place, exactly
as a synchronous save does (torchtitan's ``async_mode = "async"``, without its pinned-memory
staging). So ``last.ckpt`` is at every moment the previous complete folder or the new one, and a
kill during the background write leaves the previous one whole.

The background write runs its collectives on a process group of its own (gloo, created on every
rank at the first save, as torchtitan does): collectives of two threads on one group would
interleave in different orders on different ranks. At most one write is in flight: a save first
waits for the previous one. A failed write is raised on every rank at the next training step (the
ranks agree, with one all-reduce per step while a write is pending, that every rank's write is
over) or at the next save, whichever comes first, as :class:`CheckpointWriteError` naming the folder.
"""

from __future__ import annotations

import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import torch

ASYNC_MODES = ("disabled", "async")  # torchtitan's names


class CheckpointWriteError(OSError):
    """A sharded checkpoint could not be completed; raised on every rank, naming the folder."""


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def broadcast_object(obj: Any, group: Optional[Any] = None) -> Any:
    """Global rank 0's ``obj`` on every rank of ``group`` (``None``: the default group); ``obj``
    itself without a process group. Every rank of the group calls it."""
    if not _distributed():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0, group=group)
    return box[0]


def one_line(err: BaseException) -> str:
    """``Type: message`` of ``err`` on one line."""
    return " ".join(f"{type(err).__name__}: {err}".split())


def failure_of(err: BaseException, rank: int) -> tuple[int, str]:
    """The rank that failed and its error on one line: ``rank``'s own ``err``, or for DCP's
    ``CheckpointException`` (every rank raises it, carrying each failed rank's exception and
    traceback) the first failed rank's exception."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(err, CheckpointException) and err.failures:
        failed, wrapped = min(err.failures.items(), key=lambda item: item[0])
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        if isinstance(inner, BaseException):
            return failed, one_line(inner)
    return rank, one_line(err)


def on_every_rank(write: Callable[[], None], what: str, temp: Path, path: Path, group: Optional[Any] = None) -> None:
    """Run ``write`` on rank 0 and give its outcome to every rank of ``group``: a failure there (a
    full disk while ``meta.pt`` is written, a refused rename) raises :class:`CheckpointWriteError`
    on every rank at once, where the other ranks would otherwise wait at the next collective until
    the process-group timeout. The broadcast is the collective every rank joins, the failing rank
    included; rank 0 removes the half-written folder first."""
    failure: Optional[BaseException] = None
    if not _distributed() or torch.distributed.get_rank() == 0:
        try:
            write()
        except BaseException as err:  # a KeyboardInterrupt too: the other ranks must not wait
            failure = err
            shutil.rmtree(temp, ignore_errors=True)
    message = broadcast_object(None if failure is None else one_line(failure), group)
    if message is None:
        return
    error = CheckpointWriteError(f"{path}: the sharded checkpoint was not saved: rank 0 could not {what} "
                                 f"({message}); the previous checkpoint there is unchanged")
    if failure is not None and not isinstance(failure, Exception):
        raise failure  # an interrupt stays an interrupt on the rank it reached
    raise error from failure


class AsyncSaves:
    """The one background write of a strategy's sharded checkpoints (at most one in flight).

    Args:
        timeout: of the background write's process group (the strategy's ``timeout``).
    """

    def __init__(self, timeout: Optional[timedelta] = None) -> None:
        self.timeout = timeout
        self._group: Optional[Any] = None
        self._executor: Optional[ThreadPoolExecutor] = None
        self._pending: Optional[Future] = None
        self.pending_path: Optional[Path] = None  # the folder being written, the same on every rank
        self._after: list[Callable[[], None]] = []  # run once the write in flight is in place

    def start(self, state: dict[str, Any], temp: Path, path: Path, complete: Callable[[], None]) -> None:
        """Stage ``state`` (blocking: a copy the training step may then change) and write it to the
        folder ``temp`` in the background; then ``complete`` (rank 0: ``meta.pt``, the rename to
        ``path``) once every rank's shard is written. Every rank calls it, after :meth:`wait`."""
        import torch.distributed.checkpoint as dcp

        if self._pending is not None:
            raise RuntimeError("a sharded checkpoint write is already in flight: wait() for it first")
        if _distributed() and self._group is None:
            # Every rank reaches its first save together: new_group is a collective.
            self._group = torch.distributed.new_group(backend="gloo", timeout=self.timeout)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mmssl-checkpoint")
        try:
            written = dcp.async_save(state, checkpoint_id=temp, process_group=self._group, no_dist=not _distributed())
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)  # staging failed (out of memory) on this rank
            raise
        self._pending = self._executor.submit(self._finish, written, temp, path, complete)
        self.pending_path = path

    def _finish(self, written: Future, temp: Path, path: Path, complete: Callable[[], None]) -> None:
        """The background thread: every rank's outcome of the shard write, agreed on every rank,
        then rank 0's completion, whose outcome is broadcast (:func:`on_every_rank`)."""
        rank = torch.distributed.get_rank() if _distributed() else 0
        try:
            written.result()
            mine: Optional[tuple[int, str]] = None
        except BaseException as err:
            mine = failure_of(err, rank)
        outcomes = [mine]
        if _distributed():
            outcomes = [None] * torch.distributed.get_world_size(self._group)
            torch.distributed.all_gather_object(outcomes, mine, group=self._group)
        failed = sorted(outcome for outcome in outcomes if outcome is not None)
        if failed:
            if rank == 0:
                shutil.rmtree(temp, ignore_errors=True)
            rank, message = failed[0]
            raise CheckpointWriteError(f"{path}: the sharded checkpoint was not saved: rank {rank} could not write "
                                       f"its shard in the background ({message}); the previous checkpoint there "
                                       "is unchanged")
        on_every_rank(complete, "write meta.pt or rename the folder", temp, path, self._group)

    def after_write(self, action: Callable[[], None]) -> None:
        """Run ``action`` (in this thread) once the write in flight is in place, or now when there
        is none: Lightning's top-k clean-up removes the previous best checkpoint right after saving
        the new one, which must not go before the new one is complete. Dropped if the write fails."""
        if self._pending is None:
            action()
        else:
            self._after.append(action)

    def wait(self) -> None:
        """Wait for the write in flight, if any, then run what waited for it (:meth:`after_write`);
        raise its failure. Every rank calls it."""
        pending, self._pending, self.pending_path = self._pending, None, None
        after, self._after = self._after, []
        if pending is not None:
            pending.result()
        for action in after:
            action()

    def raise_if_failed(self, device: torch.device) -> None:
        """At a training step: once every rank's write is over (one all-reduce, only while a write
        is pending), take its outcome, raising a failure on every rank at the same step. Every
        rank calls it."""
        if self._pending is None:
            return
        done = torch.tensor([int(self._pending.done())], device=device)
        if _distributed():
            torch.distributed.all_reduce(done, op=torch.distributed.ReduceOp.MIN)
        if done.item():
            self.wait()

    def close(self) -> None:
        """Wait for the write in flight, then release the thread and the process group."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            if self._group is not None and _distributed():
                torch.distributed.destroy_process_group(self._group)
            self._group = None


__all__ = ["ASYNC_MODES", "AsyncSaves", "CheckpointWriteError", "broadcast_object", "failure_of", "on_every_rank",
           "one_line"]
