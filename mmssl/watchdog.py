"""A rank that hangs names itself, and a rank that fails takes the others down.

Each rank keeps a note of where it stands (a phase string, since when, batches received), set from
the main thread at no cost beyond an assignment. A daemon thread, once a second:

* writes that note into the run's rank folder (``<run>/.ranks/<attempt>/rank<r>.json``);
* when the rank has been in a timed phase (waiting for a batch, working on one, in a collective)
  longer than the hang timeout, claims the hang marker there with a message naming the late rank
  (the one with the fewest batches, else every rank outside a collective) and where it stands;
* when any rank's hang marker exists: writes every thread's Python stack into
  ``<run>/hang/rank<r>.txt``, has each of its data-loader workers write theirs (SIGUSR1, which
  :func:`worker_started` gave to ``faulthandler``) into ``<run>/hang/rank<r>-worker<w>.txt``, and
  ends the process, the marker's owner printing the message;
* when another rank's failure marker exists (:meth:`RankWatchdog.failed`, from the failing rank's
  exception path): waits for that rank to end (its error printed by itself, once) and ends.

The ranks learn of each other through files, not collectives (a collective is what hangs). The
attempt folder is named from what every rank of one launch shares (``MASTER_ADDR``/``MASTER_PORT``,
torchrun's run id and restart count, SLURM's job, step and restart count), so a resumed run in the
same run folder never reads an earlier attempt's markers. Torch's flight recorder does this for
NCCL only; this works for every backend, and for a stalled data-loader worker, which no collective
sees.
"""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import json
import math
import os
import shutil
import signal
import socket
import sys
import threading
import time
from typing import Any, Iterator, Mapping, Optional

HANG_ENV = "MMSSL_HANG_TIMEOUT_S"
DEFAULT_HANG_S = 1800.0  # a run without a process-group timeout (one process): torch's default
BETWEEN = "between batches"  # the untimed phase: epoch ends, callbacks, checkpoints
_ATTEMPT_KEYS = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "SLURM_JOB_ID",
                 "SLURM_STEP_ID", "SLURM_RESTART_COUNT")

_CURRENT: Optional["RankWatchdog"] = None


def hang_timeout_s(pg_timeout_s: Optional[float], env: Optional[Mapping[str, str]] = None) -> float:
    """Seconds a rank may stay in a timed phase: ``$MMSSL_HANG_TIMEOUT_S``, else 90% of the
    process-group timeout (the report comes before gloo's or NCCL's own error), else 30 min.

    Raises:
        ValueError: the variable is not a positive number of seconds, naming it.
    """
    raw = (os.environ if env is None else env).get(HANG_ENV, "").strip()
    if raw:
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"environment variable {HANG_ENV}={raw!r}: expected a number of seconds > 0 "
                             "(how long a rank may wait for a batch or a collective before every rank dumps its "
                             "stacks and the run ends)")
        return value
    return 0.9 * pg_timeout_s if pg_timeout_s else DEFAULT_HANG_S


def attempt_folder(run_folder: str, env: Optional[Mapping[str, str]] = None) -> str:
    """``<run_folder>/.ranks/<attempt>``: the same on every rank of one launch, another for the next."""
    env = os.environ if env is None else env
    key = "|".join(f"{k}={env.get(k, '')}" for k in _ATTEMPT_KEYS)
    return os.path.join(run_folder, ".ranks", hashlib.sha1(key.encode()).hexdigest()[:12])


def current() -> Optional["RankWatchdog"]:
    """The watchdog of this process's running fit, if any."""
    return _CURRENT


class RankWatchdog:
    """One rank's watchdog (see the module docstring).

    Args:
        run_folder: the run's folder, the same path on every rank (shared across machines).
        rank: this process's global rank.
        world: the number of ranks.
        timeout_s: seconds a timed phase may last (:func:`hang_timeout_s`).
        poll_s: how often the thread looks.
    """

    def __init__(self, run_folder: str, rank: int, world: int, timeout_s: float, poll_s: float = 1.0) -> None:
        self.run_folder, self.rank, self.world = run_folder, rank, world
        self.timeout_s, self.poll_s = float(timeout_s), float(poll_s)
        self.folder = attempt_folder(run_folder)
        self.stacks = os.path.join(run_folder, "hang")
        self.where, self.since, self.timed, self.batches = BETWEEN, time.time(), False, 0
        self.workers: dict[int, list[int]] = {}  # live loader iterators' worker pids
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._written: Any = None
        self._failed_here = False

    # Main thread: cheap ------------------------------------------------------------------------------

    def enter(self, where: str, timed: bool = True) -> tuple[str, float, bool]:
        """Stand at ``where`` from now; returns the previous phase for :meth:`restore`."""
        previous = (self.where, self.since, self.timed)
        self.where, self.since, self.timed = where, time.time(), timed
        return previous

    def restore(self, previous: tuple[str, float, bool]) -> None:
        self.where, self.since, self.timed = previous

    @contextlib.contextmanager
    def phase(self, where: str) -> Iterator[None]:
        """A timed phase around a block (a collective), the previous one restored after it."""
        previous = self.enter(where)
        try:
            yield
        finally:
            self.restore(previous)

    def failed(self, error: BaseException) -> None:
        """This rank's run failed with ``error``: claim the failure marker, so the other ranks end.

        A rank failing after another (often because of it: its peer is gone) prints one line and
        ends once the first has ended; the first failure's error is the one printed in full.
        """
        said = f"{type(error).__name__}: {error}".splitlines()[0][:300]
        first = self._claim("failed", {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(),
                                       "error": said})
        if first:
            self._failed_here = True
        elif self.world > 1:
            # This rank's own error, in one line: often the first's again (every rank reads the same
            # config and data), sometimes another that matters (a peer's gone).
            print(f"mmssl: rank {self.rank} failed too: {said}", file=sys.stderr, flush=True)
            self._end_after_failure()

    # The thread --------------------------------------------------------------------------------------

    def start(self) -> "RankWatchdog":
        global _CURRENT
        os.makedirs(self.folder, exist_ok=True)
        _CURRENT = self
        self._thread = threading.Thread(target=self._run, name="mmssl-rank-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread and remove this rank's note (a run that ended well leaves no folder)."""
        global _CURRENT
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.poll_s)
        if _CURRENT is self:
            _CURRENT = None
        with contextlib.suppress(OSError):
            os.remove(self._path(f"rank{self.rank}.json"))
        if self.rank == 0 and not self._markers():
            shutil.rmtree(self.folder, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(self.folder))

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.check()
            except OSError:  # a full or vanished run folder must not end the run: look again later
                pass

    def check(self) -> None:
        """One look (what the thread does each ``poll_s``)."""
        note = (self.where, self.since, self.timed, self.batches)
        if note != self._written:
            self._write_json(f"rank{self.rank}.json", {"rank": self.rank, "pid": os.getpid(), "where": note[0],
                                                      "since": note[1], "timed": note[2], "batches": note[3]})
            self._written = note
        if self.world > 1 and not self._failed_here:
            failure = self._read_json("failed")
            if failure is not None and failure.get("rank") != self.rank:
                self._end_after_failure(failure)
        hang = self._read_json("hang")
        if hang is None and self.timed and time.time() - self.since > self.timeout_s:
            if self._claim("hang", {"rank": self.rank, "message": self.hang_message()}):
                hang = self._read_json("hang")
        if hang is not None:
            self._end_on_hang(hang)

    def hang_message(self) -> str:
        """Which rank is late, and where every rank stands (from their notes)."""
        now, notes = time.time(), []
        for rank in range(self.world):
            note = self._read_json(f"rank{rank}.json")
            if rank == self.rank:
                note = {"rank": rank, "where": self.where, "since": self.since, "batches": self.batches}
            notes.append(note or {"rank": rank, "where": "no note (not started, or its folder is not shared)",
                                  "since": now, "batches": -1})
        counts = {n["batches"] for n in notes}
        if len(counts) > 1:
            late = [n for n in notes if n["batches"] == min(counts)]
        else:
            late = [n for n in notes if not n["where"].startswith("in a collective")] or notes

        def says(n: dict) -> str:
            return f"rank {n['rank']}: {n['where']} for {now - n['since']:.0f} s"

        others = [says(n) for n in notes if n not in late]
        head = "; ".join(says(n) for n in late)
        verb = "is" if len(late) == 1 else "are"
        who = ", ".join(f"rank {n['rank']}" for n in late)
        text = f"mmssl: hang: {who} {verb} late ({head})"
        if others:
            text += f"; {'; '.join(others)}"
        return (f"{text}. Every rank's and data-loader worker's Python stacks: {self.stacks} "
                f"(timeout {self.timeout_s:.0f} s, ${HANG_ENV})")

    # Ending ------------------------------------------------------------------------------------------

    def _end_on_hang(self, hang: dict) -> None:
        self.dump_stacks()
        deadline = time.time() + 5 * self.poll_s  # the others dump too before any rank ends
        while time.time() < deadline and not all(
                os.path.exists(os.path.join(self.stacks, f"rank{r}.txt")) for r in range(self.world)):
            time.sleep(0.1)
        if hang.get("rank") == self.rank:
            print(hang["message"], file=sys.stderr, flush=True)
        else:
            print(f"mmssl: rank {self.rank} ends: rank {hang.get('rank')} found the run hung (its message names "
                  f"the late rank); stacks in {self.stacks}", file=sys.stderr, flush=True)
        _kill(self._worker_pids(), signal.SIGKILL)
        os._exit(1)

    def _end_after_failure(self, failure: Optional[dict] = None) -> None:
        deadline = time.time() + 5
        while failure is None and time.time() < deadline:  # claimed, its content not written yet
            failure = self._read_json("failed")
            if failure is None:
                time.sleep(0.05)
        failure = failure or {}
        print(f"mmssl: rank {self.rank} ends: rank {failure.get('rank')} failed ({failure.get('error')}; its own "
              "output has the traceback)", file=sys.stderr, flush=True)
        # The failing rank prints its error as it ends; under Lightning's launcher it is rank 0, the
        # others' parent, which SIGKILLs itself when a child exits non-zero: end after it, not before.
        if failure.get("host") == socket.gethostname() and isinstance(failure.get("pid"), int):
            deadline = time.time() + 30
            while _alive(failure["pid"]) and time.time() < deadline:
                time.sleep(0.1)
        else:
            time.sleep(2)
        _kill(self._worker_pids(), signal.SIGKILL)
        os._exit(1)

    def dump_stacks(self) -> None:
        """Every thread's stack into ``<run>/hang/rank<r>.txt``, and each live loader worker's into
        ``rank<r>-worker<w>.txt`` beside it (the worker writes into the attempt folder on SIGUSR1)."""
        os.makedirs(self.stacks, exist_ok=True)
        pids = self._worker_pids()
        _kill(pids, signal.SIGUSR1)
        part = os.path.join(self.stacks, f"rank{self.rank}.txt.part")
        with open(part, "w") as f:
            f.write(f"rank {self.rank} (pid {os.getpid()}): {self.where} for {time.time() - self.since:.0f} s; "
                    f"data-loader worker pids {pids}\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        files = {pid: name for name in os.listdir(self.folder) for pid in pids
                 if name.startswith(f"rank{self.rank}-worker") and name.endswith(f"-{pid}.txt")}
        # faulthandler writes a worker's threads one after another, the main thread (where a stalled
        # dataset is) last: copy once every file is non-empty and has stopped growing, not at its
        # first bytes (a worker with a thread of its own was copied with that thread's stack only).
        deadline, sizes = time.time() + 5, None
        while time.time() < deadline:
            now = {n: _size(self._path(n)) for n in files.values()}
            if all(now.values()) and now == sizes:
                break
            sizes = now
            time.sleep(0.2)
        for name in files.values():
            shutil.copyfile(self._path(name), os.path.join(self.stacks, name.rsplit("-", 1)[0] + ".txt"))
        os.replace(part, os.path.join(self.stacks, f"rank{self.rank}.txt"))

    # Files ---------------------------------------------------------------------------------------------

    def _path(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def _markers(self) -> bool:
        return any(os.path.exists(self._path(m)) for m in ("failed", "hang"))

    def _claim(self, name: str, content: dict) -> bool:
        """Create marker ``name`` if no rank has: whether this rank did."""
        os.makedirs(self.folder, exist_ok=True)
        try:
            fd = os.open(self._path(name) + ".claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        os.close(fd)
        self._write_json(name, content)
        return True

    def _write_json(self, name: str, content: dict) -> None:
        part = self._path(f"{name}.{os.getpid()}.part")
        with open(part, "w") as f:
            json.dump(content, f)
        os.replace(part, self._path(name))

    def _read_json(self, name: str) -> Optional[dict]:
        try:
            with open(self._path(name)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def _worker_pids(self) -> list[int]:
        return sorted({pid for pids in list(self.workers.values()) for pid in pids})


def watched(iterator: Iterator[Any], num_workers: int) -> Iterator[Any]:
    """``iterator`` (a DataLoader's), each wait for a batch a timed phase of the running watchdog
    naming the worker it waits for; the phase is ``BETWEEN`` once the loader is exhausted."""
    dog = current()
    if dog is None:
        yield from iterator
        return
    key = id(iterator)
    dog.workers[key] = [w.pid for w in getattr(iterator, "_workers", ())]  # torch's worker processes
    received = 0
    try:
        while True:
            if num_workers:
                worker = _next_worker(iterator, received, num_workers)
                dog.enter(f"waiting for a batch from data-loader worker {worker}")
            else:
                dog.enter("reading a batch (no data-loader workers)")
            try:
                batch = next(iterator)
            except StopIteration:
                dog.enter(BETWEEN, timed=False)
                return
            received += 1
            dog.batches += 1
            dog.enter("working on a batch", timed=dog.world > 1)  # a step's collectives, between ranks
            yield batch
    finally:
        for pid in dog.workers.pop(key, ()):  # the stack files its workers opened
            with contextlib.suppress(OSError):
                for name in os.listdir(dog.folder):
                    if name.startswith(f"rank{dog.rank}-worker") and name.endswith(f"-{pid}.txt"):
                        os.remove(os.path.join(dog.folder, name))


def _next_worker(iterator: Any, received: int, num_workers: int) -> int:
    """The worker whose batch is next: torch's task record, else round-robin order."""
    info = getattr(iterator, "_task_info", {}).get(getattr(iterator, "_rcvd_idx", None))
    if info:
        return int(info[0])
    return received % num_workers


def worker_started(rank: int, folder: Optional[str], worker_id: int) -> None:
    """In a data-loader worker: SIGUSR1 writes its stacks into ``folder`` (its rank's watchdog
    folder), where the rank's watchdog collects them on a hang."""
    if folder is None:
        return
    path = os.path.join(folder, f"rank{rank}-worker{worker_id}-{os.getpid()}.txt")
    try:
        file = open(path, "w")
    except OSError:
        return
    _WORKER_FILES.append(file)  # kept open: faulthandler writes into its descriptor
    faulthandler.register(signal.SIGUSR1, file=file, all_threads=True, chain=False)


_WORKER_FILES: list = []


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    except IndexError:
        return True


def _kill(pids: list[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signum)
