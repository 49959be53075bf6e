"""The SIGTERM watchdog (``mmssl.signals``) ends the process it runs in, and only for its own SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

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
