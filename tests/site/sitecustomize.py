"""Imported by every Python process the CLI tests start (``tests.cli_runs.cli_env`` puts this
folder on ``PYTHONPATH``): each rank prints every thread's stack once, ``$MMSSL_TEST_STACKS_AFTER_S``
seconds after it started, if it is still running then.

Why: a 2-process run in a full-suite CI run once failed with rank 0 waiting at a collective until
the process-group timeout (2 min) while rank 1 was somewhere else; rank 0's traceback alone does
not say where. The dump comes a little before that timeout, so the failing test's output shows
what the late rank was doing (tests.cli_runs.run_mmssl prints the dumps of a failed run). Runs
that end sooner print nothing.
"""

import faulthandler
import os
import sys

_after = os.environ.get("MMSSL_TEST_STACKS_AFTER_S", "")
_folder = os.environ.get("MMSSL_TEST_STACKS_DIR", "")
if _after:
    # Into the run's own folder when tests.cli_runs.run_mmssl gives one (it prints the files of a
    # failed run), else onto the process's stdout.
    _file = open(os.path.join(_folder, f"{os.getpid()}.txt"), "w") if _folder else sys.stdout
    faulthandler.dump_traceback_later(float(_after), repeat=False, file=_file, exit=False)
