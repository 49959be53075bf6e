"""The package's layers (pyproject's [tool.importlinter] contracts) hold: an import only goes down.

A broken contract fails with import-linter's report, which names each import that breaks it
(``mmssl.models.clip -> mmssl.evaluation.features (l.12)``).
"""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_import_linter_contracts_hold():
    # lint-imports in a fresh interpreter: it builds the import graph from the source files only.
    run = subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout and "KEPT" in run.stdout, run.stdout[-2000:]
