"""mmssl.watchdog in process and in small subprocesses: the hang timeout, the attempt folder, the
message naming the late rank, a stalled data-loader worker's stacks on disk, workers that die
with their parent. The CLI runs on 2 gloo processes: tests/test_watchdog_cli.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mmssl.watchdog import BETWEEN, RankWatchdog, attempt_folder, hang_timeout_s
from tests.cli_runs import REPO


def test_the_hang_timeout_comes_from_the_environment_else_below_the_process_group_timeout():
    assert hang_timeout_s(300.0, {}) == 270.0
    assert hang_timeout_s(None, {}) == 1800.0
    assert hang_timeout_s(300.0, {"MMSSL_HANG_TIMEOUT_S": "20"}) == 20.0
    for bad in ("0", "-1", "nan", "inf", "soon"):
        with pytest.raises(ValueError, match=f"MMSSL_HANG_TIMEOUT_S={bad!r}: expected a number of seconds > 0"):
            hang_timeout_s(300.0, {"MMSSL_HANG_TIMEOUT_S": bad})


def test_one_launch_shares_its_attempt_folder_and_the_next_launch_has_another():
    one = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "41000"}
    assert attempt_folder("/r", one) == attempt_folder("/r", dict(one))
    assert attempt_folder("/r", one) != attempt_folder("/r", {**one, "MASTER_PORT": "41001"})
    assert attempt_folder("/r", {"SLURM_JOB_ID": "7"}) != attempt_folder("/r", {"SLURM_JOB_ID": "7",
                                                                                 "SLURM_RESTART_COUNT": "1"})
    assert attempt_folder("/r", one).startswith("/r/.ranks/")


def test_the_message_names_the_rank_with_fewer_batches_and_where_it_stands(tmp_path):
    dogs = [RankWatchdog(str(tmp_path), rank, 2, timeout_s=1000) for rank in range(2)]
    dogs[0].batches, dogs[1].batches = 3, 2
    dogs[0].enter("working on a batch")
    dogs[1].enter("waiting for a batch from data-loader worker 0")
    dogs[1].since -= 300
    os.makedirs(dogs[0].folder)
    for dog in dogs:
        dog.check()  # writes its note
    message = dogs[0].hang_message()
    assert message.startswith("mmssl: hang: rank 1 is late (rank 1: waiting for a batch from data-loader worker 0 "
                              "for 300 s); rank 0: working on a batch for 0 s."), message
    assert str(tmp_path / "hang") in message
    # Same progress: the rank outside a collective is the late one.
    dogs[0].batches = 2
    dogs[0].enter("in a collective (strategy.barrier)")
    dogs[1].enter(BETWEEN, timed=False)
    dogs[1].check()
    assert dogs[0].hang_message().startswith("mmssl: hang: rank 1 is late (rank 1: between batches")


STALLED_WORKER = """
import sys, time
sys.path[:0] = [{repo!r}]
import torch
from torch.utils.data import IterableDataset
from mmssl.data.state import EpochLoader
from mmssl.watchdog import RankWatchdog

class Spec:
    seed = 0

class Stalls(IterableDataset):
    spec = Spec()
    def set_run(self, run):
        pass
    def __iter__(self):
        def stalled_in_the_worker():
            time.sleep(600)
        yield torch.zeros(1)
        stalled_in_the_worker()

if __name__ == "__main__":
    RankWatchdog({folder!r}, 0, 1, timeout_s=2, poll_s=0.2).start()
    for batch in EpochLoader(Stalls(), num_workers=1):
        print("got a batch", flush=True)
"""


def test_a_stalled_worker_ends_the_run_naming_it_with_every_stack_on_disk(tmp_path):
    """One process, its loader's worker stalls after one batch: 2 s later (the timeout) the rank's
    and the worker's stacks are in <run>/hang and the process ends with the message."""
    script = tmp_path / "stall.py"
    script.write_text(STALLED_WORKER.format(repo=str(REPO), folder=str(tmp_path / "run")))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "got a batch" in proc.stdout
    assert "mmssl: hang: rank 0 is late (rank 0: waiting for a batch from data-loader worker 0 for " in proc.stderr
    hang = tmp_path / "run" / "hang"
    assert "waiting for a batch from data-loader worker 0" in (hang / "rank0.txt").read_text()
    worker = (hang / "rank0-worker0.txt").read_text()
    assert "stalled_in_the_worker" in worker, worker
    assert time.monotonic() - start < 200
    # The stalled worker (and its fork server) ended with the process: none is left behind.
    pids = (hang / "rank0.txt").read_text().split("data-loader worker pids [", 1)[1].split("]", 1)[0]
    deadline = time.monotonic() + 10
    while any(_running(int(p)) for p in pids.split(",")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_running(int(p)) for p in pids.split(",")), pids


def test_a_workers_stacks_are_copied_once_its_dump_is_whole(tmp_path, monkeypatch):
    """A worker with a thread of its own (CI's stack-dump timer; a user's dataset) dumps that thread
    first and its main thread, where the stall is, last. The copy waited only for the file's first
    bytes and once kept the timer's stack alone (a full-suite CI run): it waits for the whole dump."""
    dog = RankWatchdog(str(tmp_path / "run"), 0, 1, timeout_s=1000)
    os.makedirs(dog.folder)
    worker = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                               "signal.signal(signal.SIGUSR1, signal.SIG_IGN); print(1, flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline().strip() == "1"
        dump = Path(dog.folder) / f"rank0-worker0-{worker.pid}.txt"
        dump.write_text("Thread 0x1 (most recent call first):\n  File \"threading.py\", line 1 in run\n\n")
        dog.workers[0] = [worker.pid]
        sleep = time.sleep

        def the_worker_goes_on(seconds: float) -> None:  # its main thread's stack lands a moment later
            if "stalled_in_the_worker" not in dump.read_text():
                with open(dump, "a") as f:
                    f.write("Current thread 0x2 (most recent call first):\n  File \"x.py\", line 2 in "
                            "stalled_in_the_worker\n")
            sleep(seconds)

        monkeypatch.setattr(time, "sleep", the_worker_goes_on)
        dog.dump_stacks()
    finally:
        worker.kill()
        worker.wait()
    copied = (tmp_path / "run" / "hang" / "rank0-worker0.txt").read_text()
    assert copied == dump.read_text() and "stalled_in_the_worker" in copied, copied


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


DIES_WITH_PARENT = """
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path[:0] = [{repo!r}]; "
                          "from mmssl.signals import die_with_parent; assert die_with_parent(); "
                          "print('ready', flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "ready"
print(child.pid, flush=True)
os._exit(0)  # the parent dies, the child is not waited for
"""


def test_a_process_that_asked_dies_with_its_parent():
    proc = subprocess.run([sys.executable, "-c", DIES_WITH_PARENT.format(repo=str(REPO))], capture_output=True,
                          text=True, timeout=120)
    pid = int(proc.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[1][:3]


def test_the_process_group_timeout_is_read_from_lightnings_strategy():
    """The default hang timeout rests on Lightning keeping the strategy's timeout as ``_timeout``."""
    from datetime import timedelta

    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    from mmssl.callbacks.watchdog import pg_timeout_s

    assert pg_timeout_s(DDPStrategy(timeout=timedelta(minutes=5))) == 300.0
    assert pg_timeout_s(SingleDeviceStrategy("cpu")) is None


SECOND_FAILURE = """
import os, sys, threading, time
sys.path[:0] = [{repo!r}]
from mmssl.watchdog import RankWatchdog

first, second = (RankWatchdog({folder!r}, rank, 2, timeout_s=1000) for rank in range(2))
os.makedirs(first.folder)
# Rank 0 has claimed the failure and not written it yet (the window between the two) ...
open(first._path("failed") + ".claim", "w").close()
def write_later():
    time.sleep(0.5)
    first._write_json("failed", {{"rank": 0, "pid": 1, "host": "another-host", "error": "ValueError: first"}})
threading.Thread(target=write_later).start()
# ... when rank 1 fails too, with its own error.
second.failed(ValueError("data.train_data='x': the second rank's own words"))
print("not reached", flush=True)
"""


def test_a_rank_failing_second_prints_its_own_error_and_the_first_ranks(tmp_path):
    """Both ranks often fail alike (one config, one data): the second prints its own error in one
    line and names the first rank's, even when it reads the marker before the first wrote it."""
    script = tmp_path / "second.py"
    script.write_text(SECOND_FAILURE.format(repo=str(REPO), folder=str(tmp_path / "run")))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "not reached" not in proc.stdout
    assert ("mmssl: rank 1 failed too: ValueError: data.train_data='x': the second rank's own words"
            in proc.stderr), proc.stderr
    assert "mmssl: rank 1 ends: rank 0 failed (ValueError: first; its own output has the traceback)" in proc.stderr
