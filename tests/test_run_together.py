"""The harness that starts a run's ranks together (tests/cli_runs.run_together): a rank that
writes more than a pipe holds while the test waits on another rank must not block."""

from __future__ import annotations

import sys

import pytest

from tests.cli_runs import run_together

# Process 0 ends only after process 1 has ended (as rank 0 waits for rank 1 at a collective);
# process 1 first writes 256 KiB, four times what a pipe holds.
WAITS = "import os, sys, time\nwhile not os.path.exists(sys.argv[1]): time.sleep(0.05)\nprint('zero done')"
WRITES = "import sys\nsys.stdout.write('x' * (256 << 10) + '\\n'); sys.stdout.flush()\nopen(sys.argv[1], 'w').close()"


def test_a_rank_writing_more_than_a_pipe_holds_does_not_block_the_others(tmp_path):
    flag = str(tmp_path / "one_done")
    (code0, out0), (code1, out1) = run_together([[sys.executable, "-c", WAITS, flag],
                                                 [sys.executable, "-c", WRITES, flag]], timeout=60)
    assert (code0, code1) == (0, 0) and out0.strip() == "zero done" and len(out1) == (256 << 10) + 1


def test_a_process_outliving_the_timeout_is_killed_and_named(tmp_path):
    with pytest.raises(AssertionError, match=r"(?s)2 processes started together did not all finish in 2 s.*sleeping"):
        run_together([[sys.executable, "-c", "print('sleeping', flush=True); import time; time.sleep(60)"],
                      [sys.executable, "-c", "pass"]], timeout=2)
