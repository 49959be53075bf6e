"""SIGTERM ends a run, even one stuck in a collective.

Lightning's SIGTERM handler is Python code: it runs only when the main thread returns to the
interpreter, which a rank blocked in a collective (a peer that died or desynchronised) never does,
and the handler itself broadcasts to the other ranks. ``timeout``, a cluster's pre-emption or a
user's ``kill`` is then ignored until the process-group timeout, or forever without one. Python
writes each signal's number to a "wakeup" file descriptor from its C-level handler, at once,
whatever the main thread is doing; a daemon thread waits on it, gives Lightning a grace period to
stop cleanly, and then ends the process with SIGTERM's usual exit status. The ranks it leaves
see their peer gone and fail in their next collective.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from typing import Mapping, Optional

GRACE_ENV = "MMSSL_SIGTERM_GRACE_S"
DEFAULT_GRACE_S = 60.0


def sigterm_grace_s(env: Optional[Mapping[str, str]] = None) -> float:
    """The grace period from ``$MMSSL_SIGTERM_GRACE_S`` (default 60 s), checked.

    Raises:
        ValueError: the value is not a finite number of seconds >= 0 (a negative or endless
            grace would lose the hard exit), naming the variable and its value.
    """
    raw = (os.environ if env is None else env).get(GRACE_ENV, "")
    if raw.strip() == "":
        return DEFAULT_GRACE_S
    try:
        grace = float(raw)
    except ValueError:
        grace = math.nan
    if not math.isfinite(grace) or grace < 0:
        raise ValueError(f"environment variable {GRACE_ENV}={raw!r}: expected a number of seconds >= 0 "
                         f"(the wait between SIGTERM and the hard exit; default {DEFAULT_GRACE_S:g})")
    return grace


def install_sigterm_watchdog(grace_s: float | None = None) -> bool:
    """After a SIGTERM, exit hard if the process is still alive ``grace_s`` seconds later.

    Call once from the main thread, before training. Lightning's own handler still runs first
    whenever it can (it stops the loop at the next step and kills its child ranks).

    Args:
        grace_s: seconds to wait (finite, >= 0); ``None`` reads ``$MMSSL_SIGTERM_GRACE_S``
            (:func:`sigterm_grace_s`).

    Returns:
        Whether it was installed (not where a wakeup descriptor is already in use, e.g. asyncio,
        or outside the main thread).

    Raises:
        ValueError: a negative or non-finite grace period.
    """
    grace = sigterm_grace_s() if grace_s is None else float(grace_s)
    if not math.isfinite(grace) or grace < 0:
        raise ValueError(f"grace_s={grace_s!r}: expected a number of seconds >= 0")
    global _FORK_HOOKED
    if not _FORK_HOOKED:
        # SIGTERM is held across the fork, so none reaches the child before it has let go.
        os.register_at_fork(before=_hold_sigterm, after_in_parent=_release_sigterm, after_in_child=_in_forked_child)
        _FORK_HOOKED = True
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except ValueError:  # not the main thread
        return False
    if previous != -1:  # someone else's descriptor: leave it in place
        signal.set_wakeup_fd(previous)
        return False
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        # The C handler writes to the descriptor only for signals with a Python handler; until
        # Lightning installs its own, this one keeps SIGTERM's default of ending the process.
        signal.signal(signal.SIGTERM, _exit_now)

    def watch() -> None:
        while True:
            if signal.SIGTERM in os.read(read_fd, 64):
                time.sleep(grace)
                os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="mmssl-sigterm-watchdog", daemon=True).start()
    return True


_FORK_HOOKED = False
_MASK_BEFORE_FORK: set = set()


def _hold_sigterm() -> None:
    global _MASK_BEFORE_FORK
    _MASK_BEFORE_FORK = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


def _release_sigterm() -> None:
    signal.pthread_sigmask(signal.SIG_SETMASK, _MASK_BEFORE_FORK)


# What a forked child does with a signal its parent handles in Python. The handlers a fork keeps are
# the rank's (Lightning's), which act for the trainer: on SLURM's SIGUSR1 (sent to every process of
# the job step: tools/slurm/train.sbatch), Lightning's saves a checkpoint, with collectives over the
# rank's process group whose connections the child shares, and requeues the job; so each data-loader
# worker did, beside its rank. On SIGTERM, Lightning's broadcasts over that group; torch's loader
# workers replace it with their own handler once started (checked: tests/test_signals.py), other
# forked children did not. A child takes SIGTERM's default and leaves SIGUSR1 / SIGUSR2 to its rank.
_IN_FORKED_CHILD = {signal.SIGTERM: signal.SIG_DFL, signal.SIGUSR1: signal.SIG_IGN, signal.SIGUSR2: signal.SIG_IGN}


def _in_forked_child() -> None:
    """In a forked child (a data loader worker): its signals are its own.

    A fork keeps the wakeup descriptor and the Python handlers: a worker would write its SIGTERM
    into its rank's pipe (the rank's watchdog would end a healthy run one grace period later) and
    run the rank's handlers (``_IN_FORKED_CHILD``). Python handlers are replaced before SIGTERM,
    held across the fork, is let through."""
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:  # forked from another thread: that child has no wakeup descriptor to clear
        pass
    for signum, action in _IN_FORKED_CHILD.items():
        if callable(signal.getsignal(signum)):
            try:
                signal.signal(signum, action)
            except ValueError:  # not the child's main thread
                pass
    _release_sigterm()


def _exit_now(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(signum: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``signum`` to this process when its parent ends (Linux ``prctl``).

    Data-loader workers call it: torch's own check that the parent is gone runs only between batches
    (a worker stuck in a read or a lock never gets there), and a worker left behind holds its share
    of memory and files until someone kills it.

    Returns:
        Whether it was set (Linux only); ``False`` where the parent already ended.
    """
    import ctypes
    import ctypes.util

    parent = os.getppid()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    return os.getppid() == parent  # the parent may have ended before the call


def die_with(pid: int, signum: int = signal.SIGKILL) -> None:
    """End this process with ``signum`` as soon as process ``pid`` ends (a daemon thread waits on it).

    A data-loader worker is the child of its rank's fork server, not of the rank
    (:mod:`mmssl.data.state`), and each worker holds the server's "rank alive" pipe open (CPython
    passes it to every child the server forks), so a worker stuck in its own code outlived a rank
    that died, and kept the server alive beside it: this ends both with the rank.
    """
    import select

    def wait() -> None:
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            fd = None
        if fd is not None:
            select.select([fd], [], [])  # readable once the process has ended
        else:
            while True:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                except PermissionError:
                    pass
                time.sleep(1.0)
        os.kill(os.getpid(), signum)

    threading.Thread(target=wait, name="mmssl-die-with-rank", daemon=True).start()
