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


# A rank's Python handlers (Lightning's act for the trainer: on SIGTERM they kill the rank's other
# processes and broadcast over its process group; on SLURM's SIGUSR1 they save and requeue), then a
# forked data-loader worker signalled on its own: by torch's terminate(), or by SLURM's SIGUSR1 to
# every process of the step.
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
    """SIGTERM ends the worker (its default: what torch's terminate() means), SIGUSR1 is left to
    the rank; neither runs the rank's handler in the worker (Lightning's broadcast over the rank's
    process-group sockets from there, and requeued a SLURM job)."""
    proc = subprocess.run([sys.executable, "-c", WORKER_SCRIPT, signum], env=cli_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[:2] == [f"child {child}", ""], proc.stdout
