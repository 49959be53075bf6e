"""The SIGTERM watchdog (``mmssl.signals``) ends the process it runs in, and only for its own SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from tests.cli_runs import cli_env

# A process like a training rank: the watchdog, a Python SIGTERM handler (Lightning installs one),
# and a forked child as torch's data loader makes them, which the loader may end with SIGTERM.
SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from mmssl.signals import install_sigterm_watchdog

    assert install_sigterm_watchdog(grace_s=0.5)
    signal.signal(signal.SIGTERM, lambda *a: None)  # a handler that lets the process carry on
    pid = os.fork()
    if pid == 0:
        time.sleep(1)
        os._exit(0)
    # At once: a SIGTERM that reaches the child before its fork hooks ran must not count either.
    os.kill(pid if sys.argv[1] == "child" else os.getpid(), signal.SIGTERM)  # the loader's worker.terminate()
    os.waitpid(pid, 0)
    time.sleep(2)  # four grace periods
    print("alive")
""")


def _run(target: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, target], env=cli_env(), capture_output=True, text=True,
                          timeout=60)


def test_a_forked_worker_ended_by_sigterm_leaves_its_rank_running():
    proc = _run("child")
    assert proc.returncode == 0 and proc.stdout.strip() == "alive", proc.stderr[-2000:]


def test_the_process_own_sigterm_still_ends_it_after_the_grace_period():
    proc = _run("self")
    assert proc.returncode == 128 + signal.SIGTERM and "alive" not in proc.stdout, proc.stderr[-2000:]


# A rank's Python handlers (Lightning's act for the trainer: on SIGTERM they broadcast over its
# process group; on SLURM's SIGUSR1 they save a checkpoint and requeue), then a forked child
# signalled on its own: by a terminate(), or by SLURM's SIGUSR1 to every process of the step.
WORKER_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from mmssl.signals import install_sigterm_watchdog

    assert install_sigterm_watchdog(grace_s=30)
    parent = os.getpid()
    def handler(signum, frame):
        print("handler", signum, "in the child" if os.getpid() != parent else "in the rank", flush=True)
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGUSR1, handler)
    pid = os.fork()
    if pid == 0:
        time.sleep(3)
        os._exit(7)
    time.sleep(0.5)
    os.kill(pid, getattr(signal, sys.argv[1]))
    print("child", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
""")


@pytest.mark.parametrize("signum,child", [("SIGTERM", -signal.SIGTERM), ("SIGUSR1", 7)])
def test_a_forked_worker_never_runs_its_ranks_handlers(signum, child):
    """SIGTERM ends a forked child (its default: what torch's terminate() means), SIGUSR1 is left to
    the rank; neither runs the rank's handler in the child (Lightning's: a broadcast over the rank's
    process-group connections, or on SLURM's SIGUSR1 a checkpoint and a requeue)."""
    proc = subprocess.run([sys.executable, "-c", WORKER_SCRIPT, signum], env=cli_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[:2] == [f"child {child}", ""], proc.stdout


LOADER_SCRIPT = textwrap.dedent("""
    import os, signal, time
    import torch
    from torch.utils.data import DataLoader, IterableDataset
    from mmssl.signals import install_sigterm_watchdog

    assert install_sigterm_watchdog(grace_s=30)
    rank = os.getpid()
    signal.signal(signal.SIGUSR1, lambda *a: print("handler in", "the rank" if os.getpid() == rank else "a worker",
                                                   flush=True))

    class Slow(IterableDataset):
        def __iter__(self):
            for i in range(100):
                time.sleep(0.1)
                yield torch.tensor(i)

    batches = iter(DataLoader(Slow(), num_workers=1, batch_size=None))
    next(batches)
    os.kill(batches._workers[0].pid, signal.SIGUSR1)  # SLURM signals every process of the step
    time.sleep(0.5)
    print("next batch", int(next(batches)), flush=True)
""")


def test_slurms_sigusr1_to_a_data_loader_worker_is_left_to_its_rank():
    """Lightning's SLURM handler (save a checkpoint, requeue the job) ran in each torch loader
    worker that SLURM's SIGUSR1 reached (torch's workers replace the SIGTERM handler, not this one)."""
    proc = subprocess.run([sys.executable, "-c", LOADER_SCRIPT], env=cli_env(), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == "next batch 1\n", proc.stdout
