"""Where the training stream stands, and the loader that starts each epoch from it.

The stream of each worker is a deterministic function of (seed, epoch plan, rank, worker)
(:mod:`mmssl.data.pipeline`). The position is then a few integers per worker: the batches it has
served this epoch and the raw samples it consumed for them. Resumed on the same topology (ranks,
workers, batch size, shuffle buffer), a worker re-reads its pieces and drops that many raw samples
*before decoding* (tar reads only), then continues: exactly the batches the uninterrupted run
would have served next. Resumed on another topology, the consumed samples of every old slot follow
from its raw count (:func:`mmssl.data.plan.remaining`, a simulation of its shuffle buffer), and
the rest of the epoch is dealt afresh over the new slots (an elastic resume): every remaining
sample is read once, none consumed is read again, and what cannot fill a global batch is left out
and reported.
"""

from __future__ import annotations

import functools
import io
import multiprocessing
import os
import pickle
from typing import Any, Callable, Optional, Sequence

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader

from mmssl.data.pipeline import EpochRun, ShardStream, StreamSpec
from mmssl.data.plan import EpochPlan, Generation, Topology
from mmssl.watchdog import current as current_watchdog
from mmssl.watchdog import watched

# How loader workers start. Not by fork from the rank (torch's default on Linux): a rank forks while
# gloo's threads (gloo_tcp_loop, two pt_gloo_runloop), the TCP store's, Lightning's child observer,
# the SIGTERM watchdog and the queue feeders of a loader still open (the training loader's, while
# validation starts its own) run, so a worker inherits any lock one of them held at that instant,
# held forever, plus the rank's gloo sockets, signal handlers and every object (with finalizers)
# of the rank's heap. The CI hang (a worker of rank 1 that never handed over a batch) is of that
# kind as far as can be told (it was not reproduced; earlier fixes removed two inherited handlers
# that used the rank's connections), and tests/data/test_worker_start.py shows a forked worker wait
# forever on a lock a thread of the rank held. A fork server is one clean process per rank (a fresh
# interpreter that imports the data code and the tokenizer's modules once) that forks the workers:
# they inherit nothing of the rank. Measured (tests' tiny set, open_clip tokenizer, 2 workers, 2
# cores at load 6, first batch of an epoch): fork 0.6-0.8 s; forkserver 18 s for the rank's first
# loader when nothing overlaps the server's imports (the data module starts it in setup, so the
# model's build does: :func:`start_worker_server`), then 0.7-0.8 s, as fork; forkserver importing
# only the stream's module, 7-12 s at every epoch (each worker imported the rest); spawn 28 s at
# every epoch (each worker imports torch): too slow for workers started per epoch.
# The demo (configs/demo/clip.yaml's data: batch 128 of 64 px, 2 workers, load 5.7): fork 2.1-2.6 s,
# forkserver 36 s for the first loader with no overlap, then 2.5-3.3 s.
# Not the default yet: each rank's server imports Lightning and open_clip (12.6 s of CPU), which
# made a 2-process test 1.8x slower (tests/callbacks/test_guards_ddp.py: 38.5 s fork, 70.9 s
# forkserver, same load) and the suite far past its time. (An image folder's mid-epoch resume
# failed under it once, tests/data/test_folders.py: the test had patched the folder shard size in
# its own process, which the server's workers, importing mmssl afresh, did not see; not a defect of
# the reader.) ``$MMSSL_WORKER_START=forkserver`` opts in; fork stays torch's default.
WORKER_START_ENV = "MMSSL_WORKER_START"
DEFAULT_WORKER_START = "fork"
_PRELOAD = ["mmssl.data.datamodule"]


def worker_context(preload: Sequence[str] = ()) -> multiprocessing.context.BaseContext:
    """The multiprocessing context loader workers start from (see ``DEFAULT_WORKER_START``).

    Args:
        preload: modules the fork server imports besides the stream's (used only by the call that
            starts the server).

    Raises:
        ValueError: ``$MMSSL_WORKER_START`` names no start method of this system.
    """
    method = os.environ.get(WORKER_START_ENV, "").strip() or DEFAULT_WORKER_START
    if method not in multiprocessing.get_all_start_methods():
        raise ValueError(f"environment variable {WORKER_START_ENV}={method!r}: expected one of "
                         f"{', '.join(multiprocessing.get_all_start_methods())}")
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(sorted({*_PRELOAD, *preload}))  # kept by a server already running
    return context


def modules_of(*objects: Any) -> list[str]:
    """The modules that unpickling ``objects`` imports (of every object and class pickled), so a
    fork server can import them once: a worker that imports open_clip for its tokenizer pays
    seconds at every epoch. Objects that cannot be pickled add nothing."""
    found: set[str] = set()

    class Recorder(pickle.Pickler):
        def persistent_id(self, obj: Any) -> None:
            module = getattr(obj, "__module__", None) if isinstance(obj, type) else type(obj).__module__
            if isinstance(module, str):
                found.add(module)
            return None

    for obj in objects:
        if obj is not None:
            try:
                Recorder(io.BytesIO()).dump(obj)
            except Exception:  # noqa: BLE001 - an object that cannot be pickled fails in the loader, named there
                continue
    return sorted(m for m in found if m != "builtins" and not m.startswith("__"))


def start_worker_server(*objects: Any) -> None:
    """Start this process's fork server now, if workers start from one, importing the modules
    that ``objects`` (what the workers will receive: the tokenizer...) need: its imports then run
    beside the rank's own start-up instead of before the first batch. Returns at once."""
    context = worker_context(modules_of(*objects))
    if context.get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


def _start_worker(user_init: Optional[Callable[[int], None]], rank_pid: int, rank: int, stacks: Optional[str],
                  worker_id: int) -> None:
    """Each loader worker's first call: it dies with its rank and with its parent (the fork
    server), writes its stacks on SIGUSR1 for its rank's watchdog (:mod:`mmssl.watchdog`), and
    runs ``user_init`` if given."""
    from mmssl.signals import die_with, die_with_parent
    from mmssl.watchdog import worker_started

    die_with_parent()
    die_with(rank_pid)
    worker_started(rank, stacks, worker_id)
    if user_init is not None:
        user_init(worker_id)


def worker_arguments(dataset: Any, num_workers: int, rank: int = 0) -> dict[str, Any]:
    """DataLoader arguments that start a rank's other loaders' workers as :class:`EpochLoader`
    starts its own (``$MMSSL_WORKER_START``: the fork server, where chosen, forks none from a rank
    whose gloo, TCP-store and queue threads may hold a lock), each dying with this process. Empty
    without workers, and outside a process group (an offline tool's one process: the server's
    start-up would cost more than the fork it replaces, and no gloo thread runs there).

    Args:
        dataset: what the workers receive (its modules are the server's imports).
        num_workers: the loader's workers.
        rank: this process's rank, for the workers' stack files.
    """
    if num_workers <= 0 or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return {}
    return {"multiprocessing_context": worker_context(modules_of(dataset)),
            "worker_init_fn": functools.partial(_start_worker, None, os.getpid(), rank, None)}


def run_seed(trainer: Any = None) -> int:
    """The run's seed: ``seed_everything``'s (Lightning keeps it in ``PL_GLOBAL_SEED``; 0 without
    one), rank 0's on every rank. Processes started apart (torchrun, SLURM) each draw their own for
    ``seed_everything: true``, and ranks must plan one stream, so rank 0's is broadcast.

    Args:
        trainer: the running trainer (``None``, or one process: no broadcast).
    """
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    if trainer is not None and trainer.world_size > 1:
        seed = int(trainer.strategy.broadcast(seed, src=0))
    return seed


def run_skipped(state: dict[str, Any], rank: int) -> int:
    """This rank's share of a saved position's ``skipped`` (the run's total over all ranks): rank
    0 carries it, the others start from 0, so the sum every rank logs continues on any topology."""
    return int(state.get("skipped", 0)) if rank == 0 else 0


class StreamPosition:
    """The checkpointed position of one rank's training stream.

    Attributes:
        epoch: epoch the counters refer to (-1 before the first).
        topology: how the current generation of the epoch is read (``None`` before the first).
        history: earlier generations of this epoch (elastic resumes), oldest first.
        offset: batches each rank served this epoch in those earlier generations.
        batches: per worker, batches handed to the model this epoch (current generation).
        raw: per worker, raw samples consumed for those batches.
        skipped: bad samples and unreadable shard parts this rank skipped so far in the run (after a
            resume, rank 0 also carries the total of the run before it: :func:`run_skipped`).
        samples: samples per epoch of the data set the position refers to (exact mode).
    """

    def __init__(self) -> None:
        self.epoch = -1
        self.topology: Optional[Topology] = None
        self.history: list[Generation] = []
        self.offset = 0
        self.batches: list[int] = []
        self.raw: list[int] = []
        self.skipped = 0
        self.samples: Optional[int] = None
        self.resumed = False  # loaded from a checkpoint, no epoch started since
        self._plan: Optional[tuple[tuple, EpochPlan]] = None

    def _plan_of(self, epoch: int, spec: StreamSpec) -> EpochPlan:
        """``spec.plan`` of the position's epoch and history, kept: an elastic one simulates buffers."""
        key = (epoch, spec.topology, spec.sizes, spec.seed, tuple(self.history))
        if self._plan is None or self._plan[0] != key:
            self._plan = (key, spec.plan(epoch, self.history))
        return self._plan[1]

    def continues(self, epoch: int, spec: StreamSpec) -> Optional[EpochRun]:
        """The rest of ``epoch`` when the position stands inside it on ``spec``'s topology, else ``None``."""
        if epoch != self.epoch or self.topology != spec.topology or len(self.batches) != spec.workers:
            return None
        served = sum(self.batches)
        if not spec.exact:
            if 0 < served < (spec.rank_batches or 0):
                return EpochRun(epoch, rotation=served % spec.workers,
                                resume={w: (self.batches[w], self.raw[w]) for w in range(spec.workers)})
            return None
        if not served and not self.history:
            return None
        plan = self._plan_of(epoch, spec)
        if served >= plan.rank_batches and not self.history:
            return None  # a finished epoch read again (a new fit) starts afresh; an elastic one stays done
        # Batches went round-robin from worker 0, so the next one is worker served % workers.
        return EpochRun(epoch, plan, len(self.history), self.offset, served % spec.workers,
                        {w: (self.batches[w], self.raw[w]) for w in range(spec.workers)})

    def epoch_to_read(self, epoch: int, spec: StreamSpec) -> int:
        """The epoch a loader opened while the trainer is at ``epoch`` reads.

        Until a resumed position starts an epoch, the position decides, not the trainer: Lightning
        may open the training iterator before it restores its loops (``current_epoch`` still 0, when
        ``estimated_stepping_batches`` is asked for early), or while ``current_epoch`` still names
        an epoch that ended with the checkpoint, and trains the epoch it resumes from that iterator.
        The resumed epoch is the checkpoint's, or the next one when its last batch had been served.
        """
        if not self.resumed or self.epoch < 0:
            return epoch
        served = sum(self.batches)
        full = self._plan_of(self.epoch, spec).rank_batches if spec.exact else (spec.rank_batches or 0)
        return self.epoch + 1 if 0 < served >= full else self.epoch

    def start(self, epoch: int, spec: StreamSpec) -> EpochRun:
        """Begin iterating ``epoch``: continue it if the position is inside it, else start afresh.

        Args:
            epoch: the trainer's epoch (a resumed position may read another, see :meth:`epoch_to_read`).
            spec: this rank's stream.

        Returns:
            The run for :meth:`ShardStream.set_run`.
        """
        epoch = self.epoch_to_read(epoch, spec)
        self.resumed = False
        run = self.continues(epoch, spec)
        if run is not None:
            return run
        self.epoch, self.topology, self.history, self.offset = epoch, spec.topology, [], 0
        self.batches, self.raw = [0] * spec.workers, [0] * spec.workers
        self.samples = sum(spec.sizes) if spec.exact else None
        return EpochRun(epoch, spec.plan(epoch) if spec.exact else None)

    def _restart(self, reason: str) -> None:
        rank_zero_warn(f"{reason}: the data stream restarts epoch {self.epoch} from its beginning")
        self.epoch, self.topology, self.history, self.batches, self.raw = -1, None, [], [], []

    def update(self, worker: int, raw: int, skipped: int) -> None:
        """Record one batch handed to the model."""
        self.batches[worker] += 1
        self.raw[worker] = raw
        self.skipped += skipped

    def state_dict(
        self, raw_per_rank: Optional[list[list[int]]] = None, skipped: Optional[int] = None
    ) -> dict[str, Any]:
        """The position; ``raw_per_rank`` holds every rank's ``raw`` (all ranks in lockstep share
        ``epoch`` and ``batches``) and ``skipped`` all ranks' total, defaulting to this rank's alone."""
        topology = None if self.topology is None else vars(self.topology).copy()
        return {"epoch": self.epoch, "batches": list(self.batches),
                "raw": raw_per_rank if raw_per_rank is not None else [list(self.raw)],
                "skipped": self.skipped if skipped is None else skipped, "topology": topology, "offset": self.offset,
                "samples": self.samples,
                "history": [{"topology": vars(g.topology).copy(), "raw": [list(r) for r in g.raw]}
                            for g in self.history]}

    def load_state_dict(self, state: dict[str, Any], spec: StreamSpec) -> None:
        """Restore the position for ``spec``'s rank and topology (see the module docstring).

        Where the rest of the epoch cannot be read exactly (resampled mode on another topology, a
        checkpoint without its topology, shards of another size), the epoch restarts with a warning.
        """
        self.skipped, self.resumed = run_skipped(state, spec.rank), True
        self.epoch, self.batches, self.raw, self.offset = int(state["epoch"]), [], [], 0
        self.topology, self.history = None, []
        raw, batches = state.get("raw", []), list(state.get("batches", []))
        if not sum(batches) and not state.get("history"):
            return  # at an epoch boundary: nothing to continue
        saved = Topology(**state["topology"]) if state.get("topology") else None
        if spec.exact and state.get("samples") not in (None, sum(spec.sizes)):
            return self._restart(f"the data position was saved for {state['samples']} samples per epoch, the "
                                 f"shards now hold {sum(spec.sizes)}")
        self.samples = state.get("samples")
        history = [Generation(Topology(**g["topology"]), tuple(map(tuple, g["raw"]))) for g in state.get("history", [])]
        if saved == spec.topology and len(raw) == spec.world_size:
            self.topology, self.history, self.offset = saved, history, int(state.get("offset", 0))
            self.batches, self.raw = batches, list(raw[spec.rank])
            return
        if saved is None or len(raw) != saved.world:
            return self._restart("the data position does not record the topology it was saved on (a checkpoint "
                                 "of an older mmssl)")
        if not spec.exact:
            return self._restart(f"resampled streams continue only on the topology they were saved on ({saved})")
        self.history = history + [Generation(saved, tuple(map(tuple, raw)))]
        self.topology, self.offset = spec.topology, int(state.get("offset", 0)) + sum(batches)
        self.batches, self.raw = [0] * spec.workers, [0] * spec.workers
        plan = self._plan_of(self.epoch, spec)
        rank_zero_info(
            f"data: elastic resume of epoch {self.epoch} from {saved.world} ranks x {saved.workers} workers x "
            f"batch {saved.batch} to {spec.world_size} x {spec.workers} x {spec.batch_size}: "
            f"{plan.total} samples remain, {plan.rank_batches} batches per rank read "
            f"{plan.total - plan.left_out} of them, {plan.left_out} are left out; none consumed is read again")


class EpochLoader(DataLoader):
    """A DataLoader that tells its :class:`ShardStream` the epoch (and resume point) at each ``iter``.

    Workers are not persistent: they are started per epoch and receive the stream with its epoch
    set, which makes the epoch explicit (no counter hidden in worker copies, which only advanced
    while workers persisted). Workers start as ``DEFAULT_WORKER_START`` says (``$MMSSL_WORKER_START``).

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
        # Worker seeds come from this generator, re-seeded from (seed, epoch) at each ``iter``: a
        # DataLoader draws them from the global torch RNG otherwise, so opening a loader would
        # move the model's random stream (masks, dropout) by a step that a resumed run does not take.
        if kwargs.get("num_workers", 0) > 0:
            kwargs.setdefault("multiprocessing_context", worker_context(modules_of(dataset)))
        super().__init__(dataset, batch_size=None, persistent_workers=False, generator=torch.Generator(), **kwargs)
        self.epoch_fn, self.position, self._calls = epoch_fn, position, 0
        self._user_init = self.worker_init_fn
        if position is not None:
            # A resumed epoch has its own length (an elastic resume changes it): set it before
            # the trainer asks for ``len``.
            epoch = position.epoch_to_read(self._next_epoch(), dataset.spec)
            run = position.continues(epoch, dataset.spec)
            if run is not None:
                dataset.set_run(run)

    def _next_epoch(self) -> int:
        epoch = self.epoch_fn() if self.epoch_fn is not None else None
        return self._calls if epoch is None else epoch

    def __iter__(self):
        epoch = self._next_epoch()
        self._calls += 1
        spec = self.dataset.spec
        run = self.position.start(epoch, spec) if self.position is not None else EpochRun(epoch)
        self.dataset.set_run(run)
        self.generator.manual_seed(spec.seed * 1_000_003 + run.epoch)
        dog = current_watchdog()
        if self.num_workers > 0:
            self.worker_init_fn = functools.partial(_start_worker, self._user_init, os.getpid(), dog.rank if dog else 0,
                                                    dog.folder if dog else None)
        return watched(super().__iter__(), self.num_workers)

    # Lightning warns that a loader without these cannot resume mid-epoch; the position is
    # checkpointed by ImageTextDataModule.state_dict (with every rank's part), so the loader's
    # own state is empty.
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
