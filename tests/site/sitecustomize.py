"""Imported by every Python process the CLI tests start (``tests.cli_runs.cli_env`` puts this
folder on ``PYTHONPATH``): each rank prints every thread's stack once, ``$MMSSL_TEST_STACKS_AFTER_S``
seconds after it started, if it is still running then.

Why: a 2-process run in a full-suite CI run once failed with rank 0 waiting at a collective until
the process-group timeout (2 min) while rank 1 was somewhere else; rank 0's traceback alone does
not say where. The dump comes a little before that timeout, so the failing test's output shows
what the late rank was doing (tests.cli_runs.run_mmssl prints the dumps of a failed run). Runs
that end sooner print nothing.

Forked children (data-loader workers) dump too, when their parent's dump is due: reading the code
found no collective the ranks call in another order, and a worker of rank 1 that stops handing over
batches gives rank 0 exactly the traceback seen (rank 0 at the data module's ``data/skipped``
reduction, rank 1 in ``next(data_fetcher)``; reproduced by delaying a worker), so the next failure
should show the stalled worker's line.
"""

import faulthandler
import os
import sys

_after = os.environ.get("MMSSL_TEST_STACKS_AFTER_S", "")
_folder = os.environ.get("MMSSL_TEST_STACKS_DIR", "")
if _after:
    # Into the run's own folder when tests.cli_runs.run_mmssl gives one (it prints the files of a
    # failed run), else onto the process's stdout.
    import time

    def _arm(seconds: float) -> None:
        file = open(os.path.join(_folder, f"{os.getpid()}.txt"), "w") if _folder else sys.stdout
        faulthandler.dump_traceback_later(seconds, repeat=False, file=file, exit=False)

    _deadline = time.monotonic() + float(_after)
    _arm(float(_after))

    def _rearm_in_child() -> None:
        # A forked child (a data-loader worker) inherits no watchdog thread, and arming
        # faulthandler's own there waits forever on the parent's watchdog lock: a timer thread
        # dumps its stacks instead, when the parent's are due (or ``_after`` from now).
        import threading

        left = _deadline - time.monotonic()
        path = os.path.join(_folder, f"{os.getpid()}.txt") if _folder else None

        def dump() -> None:
            file = open(path, "w") if path else sys.stdout
            file.write(f"Forked child (pid {os.getpid()}, parent {os.getppid()}):\n")
            faulthandler.dump_traceback(file=file, all_threads=True)
            file.flush()

        timer = threading.Timer(left if left > 0 else float(_after), dump)
        timer.daemon = True
        timer.start()

    os.register_at_fork(after_in_child=_rearm_in_child)

# ``MMSSL_TEST_STALL_WORKER=RANK:BATCHES`` (tests/test_watchdog_cli.py): data-loader worker 0 of local
# rank RANK stops after handing over BATCHES batches, in a function named for its stack dump. The
# workers are forked by the rank's fork server, which imported this file with the rank's environment.
_stall = os.environ.get("MMSSL_TEST_STALL_WORKER", "")
if _stall and _stall.split(":")[0] == os.environ.get("LOCAL_RANK", "0"):

    def _stall_worker_zero() -> None:
        import time

        from mmssl.data import pipeline

        original, after = pipeline.ShardStream.__iter__, int(_stall.split(":")[1])

        def stalled_in_the_worker() -> None:
            time.sleep(600)

        def batches(self):
            import torch.utils.data

            info = torch.utils.data.get_worker_info()
            for served, batch in enumerate(original(self)):
                if served == after and info is not None and info.id == 0:
                    stalled_in_the_worker()
                yield batch

        pipeline.ShardStream.__iter__ = batches

    os.register_at_fork(after_in_child=_stall_worker_zero)
