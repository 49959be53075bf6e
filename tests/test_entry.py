"""``mmssl``, ``mmssl --help``, ``mmssl configs`` and an unknown subcommand answer without importing
torch or Lightning (half a minute on two busy cores); a run still reaches LightningCLI."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

# The console script's target, called as pip's wrapper calls it, then which heavy modules it loaded.
PROBE = """
import atexit, importlib, sys
atexit.register(lambda: print("LOADED", sorted(m for m in ("torch", "lightning") if m in sys.modules)))
module, _, function = sys.argv.pop(1).partition(":")
sys.argv[0] = "mmssl"
sys.exit(getattr(importlib.import_module(module), function)())
"""


def _console_script() -> str:
    # pyproject's [project.scripts] line (tomllib is Python 3.11's; mmssl supports 3.10)
    return re.search(r'^mmssl = "([\w.:]+)"$', (REPO / "pyproject.toml").read_text(), re.MULTILINE)[1]


def _run(target: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE, target, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("args, code, says", [
    (["--help"], 0, "usage: mmssl SUBCOMMAND"),
    ([], 2, "usage: mmssl SUBCOMMAND"),
    (["configs"], 0, "demo/clip"),
    (["probes"], 2, "did you mean probe"),
])
def test_help_configs_and_a_wrong_subcommand_import_no_torch(args, code, says):
    run = _run(_console_script(), *args)
    assert run.returncode == code, run.stderr[-2000:]
    assert says in run.stdout + run.stderr
    assert "LOADED []" in run.stdout, run.stdout[-500:]


def test_python_dash_m_mmssl_is_the_same_light_entry(tmp_path):
    run = subprocess.run([sys.executable, "-c", "import atexit, runpy, sys; sys.argv = ['mmssl', 'configs']; "
                          "atexit.register(lambda: print('LOADED', 'torch' in sys.modules)); "
                          "runpy.run_module('mmssl', run_name='__main__', alter_sys=True)"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "demo/clip" in run.stdout and "LOADED False" in run.stdout, run.stderr[-2000:]


def test_a_run_goes_on_to_lightning_cli(monkeypatch):
    import mmssl.cli
    from mmssl.entry import main

    seen = []
    monkeypatch.setattr(mmssl.cli, "main", lambda args=None: seen.append(args))
    main(["fit", "--config", "demo/clip"])
    main(["--print_config"])
    assert seen == [["fit", "--config", "demo/clip"], ["--print_config"]]
