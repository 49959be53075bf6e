"""The CLI tests' stack dumps (tests/site/sitecustomize.py) reach forked children: a data-loader
worker that stalls shows its own stack, not only its rank's wait in ``next(data_fetcher)``."""

from __future__ import annotations

import subprocess
import sys

from tests.cli_runs import cli_env

CHILD = """
import os, time
pid = os.fork()
if pid == 0:
    def stalled_in_the_worker():
        time.sleep(4)
    stalled_in_the_worker()
    os._exit(0)
os.waitpid(pid, 0)
print(pid)
"""


def test_a_forked_child_still_running_at_the_deadline_dumps_its_stacks(tmp_path):
    env = cli_env(MMSSL_TEST_STACKS_AFTER_S="1.5", MMSSL_TEST_STACKS_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    child = proc.stdout.split()[-1]
    dump = (tmp_path / f"{child}.txt").read_text()
    assert "Forked child" in dump and "stalled_in_the_worker" in dump, dump
