"""The ``mmssl`` console script and ``python -m mmssl``: answers without torch what needs none.

``mmssl``, ``mmssl --help``, ``mmssl configs`` (and ``--copy``), an unknown subcommand's error and
a tool (``mmssl export ...``, which imports what it needs itself) go through
:func:`mmssl.commands.dispatch` here, without importing torch or Lightning (seconds on a loaded
machine, half a minute on two busy cores); a run (``fit``, ``validate``, ``test``, ``predict``, or a
LightningCLI flag) goes on to :func:`mmssl.cli.main`, which imports them.
"""

from __future__ import annotations

import sys
from typing import Optional

from mmssl.commands import RUNS, dispatch
from mmssl.errors import one_line_errors


def main(args: Optional[list[str]] = None) -> None:
    """Entry point of ``mmssl``; ``args`` replaces ``sys.argv[1:]`` (tests)."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv and (argv[0] in RUNS or (argv[0].startswith("-") and argv[0] not in ("-h", "--help"))):
        from mmssl.cli import main as run

        # A config value, data or a checkpoint at fault ends the command in one line naming it
        # (mmssl.errors); mmssl.cli.main called from Python raises it, as any function does.
        with one_line_errors():
            run(args)
        return
    dispatch(args)  # exits: the overview, configs, a tool's status, or an unknown subcommand's error
