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
    monkeypatch.setenv("MMSSL_WORKER_START", "forkserver")
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


def _image_folder(root) -> str:
    from PIL import Image

    for c, colour in enumerate(("red", "blue")):
        (root / colour).mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (8, 8), (200 * (c == 0), 40 * i, 200 * (c == 1))).save(root / colour / f"{i}.png")
    return str(root)


def test_a_ranks_labelled_loaders_start_their_workers_as_its_training_loader(tmp_path, monkeypatch):
    """The probe and zero-shot callbacks' loaders (mmssl.data.labeled) run inside a rank, beside its
    gloo threads: their workers come from the fork server too, and give the batches a forked worker
    gives. An offline tool's single process (no process group) forks, as before."""
    from torchvision.transforms.functional import pil_to_tensor

    from mmssl.data.labeled import labeled_loader
    from tests.helpers import one_process_group

    monkeypatch.setenv("MMSSL_WORKER_START", "forkserver")
    data = _image_folder(tmp_path / "set")
    plain = labeled_loader(data, pil_to_tensor, batch_size=2, num_workers=1)
    assert plain.multiprocessing_context is None
    want = [b["label"].tolist() for b in plain]
    with one_process_group():
        loader = labeled_loader(data, pil_to_tensor, batch_size=2, num_workers=1)
        assert loader.multiprocessing_context.get_start_method() == "forkserver"
        got = [b["label"].tolist() for b in loader]
    assert got == want and sorted(sum(want, [])) == [0, 0, 1, 1]
