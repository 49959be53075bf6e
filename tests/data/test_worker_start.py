"""Loader workers inherit nothing of their rank (mmssl.data.state.worker_context): no lock a thread
of the rank held when the worker started, no signal handler, no file descriptor of its own."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from torch.utils.data import IterableDataset

from mmssl.data.state import EpochLoader, worker_context

# A lock of the rank, as gloo's and the TCP store's threads hold theirs while they run.
RANK_LOCK = threading.Lock()


class _Spec:
    seed = 0


class TakesTheRankLock(IterableDataset):
    """Yields whether the worker could take ``RANK_LOCK`` (within 3 s) and the worker's parent."""

    spec = _Spec()

    def set_run(self, run) -> None:
        pass

    def __iter__(self):
        taken = RANK_LOCK.acquire(timeout=3)
        if taken:
            RANK_LOCK.release()
        yield {"taken": torch.tensor(taken), "parent": torch.tensor(os.getppid())}


def test_a_worker_does_not_inherit_a_lock_a_thread_of_its_rank_holds(monkeypatch):
    """A thread of the rank holds a lock while the loader starts its worker. A forked worker (torch's
    default, mmssl's before) holds a copy of the lock that no thread of it will release: it waits
    forever (3 s here) at its first use; a worker of the fork server finds it free."""
    monkeypatch.delenv("MMSSL_WORKER_START", raising=False)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with RANK_LOCK:
            held.set()
            release.wait(60)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    held.wait(10)
    try:
        batch = next(iter(EpochLoader(TakesTheRankLock(), num_workers=1)))
    finally:
        release.set()
        thread.join()
    assert bool(batch["taken"]), "the worker inherited the rank's held lock"
    assert int(batch["parent"]) != os.getpid()  # started by the fork server, not forked from this process


def test_the_start_method_can_be_chosen_and_is_checked(monkeypatch):
    monkeypatch.setenv("MMSSL_WORKER_START", "spawn")
    assert worker_context().get_start_method() == "spawn"
    monkeypatch.setenv("MMSSL_WORKER_START", "vfork")
    with pytest.raises(ValueError, match="MMSSL_WORKER_START='vfork': expected one of"):
        worker_context()
