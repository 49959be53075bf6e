"""The failures a user causes and fixes (a config value, a data set, a checkpoint file): the ``mmssl``
command reports each in one line naming the key or file at fault, not in a traceback.

:class:`ConfigError` is a value of the config or command line that cannot run; :class:`DataError`
is data the run cannot go on with. Both subclass the built-in a caller would catch (``ValueError``,
``RuntimeError``). :func:`one_line_errors` is the ``mmssl`` command's handler (the tools have their
own, ``mmssl.tools._common.run``). It finds such an error also where a library wrapped it:
jsonargparse's instantiation error (the constructor's error is its ``__cause__``), or a DataLoader
worker's re-raise (the worker's traceback in the message). A ``ValueError`` whose message starts
with the config key it names (``model.init_args.mlm_mask_ratio must be ...``, the constructors'
convention), and the checkpoint reader's deliberate refusals (:class:`CheckpointError`, and
``mmssl.checkpoints.read.UnsafeCheckpointError``: each names its file) are one line too. Only the
link a wrapper sets on purpose (``__cause__``: ``raise ... from``, jsonargparse's) is followed, never
the error being handled when another was raised (``__context__``): a bug raised inside ``except
ConfigError:`` is a bug. Everything else keeps its traceback: a bug's is what fixes it.

Imports nothing: the light ``mmssl`` entry and the data workers import it freely.
"""

from __future__ import annotations

import contextlib
import re
import sys
from typing import Iterator, Optional


class ConfigError(ValueError):
    """A config or command-line value that cannot run; the message names the key or file."""


class DataError(RuntimeError):
    """Data the run cannot go on with (``data.max_bad_fraction`` exceeded); the message says which."""


class CheckpointError(ValueError):
    """A checkpoint file or folder the reader refuses on purpose (truncated, not a checkpoint, of
    another model kind, a shard of another save, ...); the message names it."""


# A constructor's ValueError that names its config key first (``model.init_args.x must be ...``).
_KEY_FIRST = re.compile(r"^(model|data|trainer|optimizer|lr_scheduler)\.[\w.]+\b")
# The worker's traceback that torch's DataLoader puts in the message it re-raises in the main process.
_WORKER = re.compile(r"\nOriginal Traceback \(most recent call last\):\n")
# The reader's refusal of a file that pickles code: a pickle.UnpicklingError, not a ValueError (so
# not a CheckpointError), and in a module this one may not import; matched by its class's name.
_UNSAFE_CHECKPOINT = "mmssl.checkpoints.read.UnsafeCheckpointError"


def _chain(err: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__  # a wrapper's "raise ... from", never the error it was handling


def _is_checkpoint_refusal(err: BaseException) -> bool:
    return isinstance(err, CheckpointError) or any(
        f"{cls.__module__}.{cls.__qualname__}" == _UNSAFE_CHECKPOINT for cls in type(err).__mro__)


def _text(err: BaseException) -> str:
    text = err.args[0] if isinstance(err, KeyError) and len(err.args) == 1 else str(err)
    text = str(text)
    if _WORKER.search(text):  # "Caught DataError in DataLoader worker process 0. ... mmssl.errors.DataError: ..."
        last = [line for line in text.splitlines() if line.strip()][-1]
        text = re.sub(r"^[\w.]*(Error|Exception)\w*: ", "", last.strip())
    return " ".join(text.split())


def one_line(err: BaseException) -> Optional[str]:
    """The one line that reports ``err`` (or the error it wraps), or ``None`` for a traceback's error."""
    for cause in _chain(err):
        if isinstance(cause, (ConfigError, DataError)):
            return _text(cause)
        if type(cause) is ValueError and _KEY_FIRST.match(str(cause)):
            return _text(cause)
        if _is_checkpoint_refusal(cause):
            return _text(cause)
    return None


@contextlib.contextmanager
def one_line_errors(program: str = "mmssl") -> Iterator[None]:
    """Report a user's error (:func:`one_line`) as ``PROGRAM: line`` on stderr and exit with status 1."""
    try:
        yield
    except Exception as err:
        line = one_line(err)
        if line is None:
            raise
        print(f"{program}: {line}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
