"""The code passes ruff (pyproject's [tool.ruff]: pycodestyle, pyflakes, import order, 120 columns).

A violation fails with ruff's report, one line each (``mmssl/x.py:12:1: F401 `os` imported but
unused``); ``ruff check --fix`` repairs the import-order and unused-import ones.
"""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean():
    run = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise",
         "mmssl", "tools", "tests", "benchmarks"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert "No module named ruff" not in run.stderr, "ruff is in the test extra: pip install -e '.[test]'"
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
