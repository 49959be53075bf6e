"""What every script in ``tools/`` shares: the argument names of one convention and how a tool ends.

The convention: ``--ckpt`` (a checkpoint, ``mmssl.evaluation.encoders.add_checkpoint_arguments``),
``--data`` (the input set), ``--output`` (what the tool writes), ``--output-json`` (its figures as
JSON), ``--images`` (one or many), ``--batch-size``, ``--num-workers``. ``main(argv=None) -> int``
returns 0 on success and 1 on an expected failure, after one line on stderr naming the file or key
at fault, or the optional dependency to install (:func:`run`); a usage error exits 2 (argparse's
``SystemExit(2)``, also in-process).

A spelling a user may have in scripts stays accepted as a hidden, deprecated alias
(:func:`add_option`): not shown in ``--help`` except as a note in the new option's help.

The tools import this as ``mmssl.tools._common``: the package maps this folder to ``mmssl.tools``
(setup.py; an editable install too), so a tool runs alike as ``mmssl X``, ``python -m mmssl.tools.X``,
``python tools/X.py`` in a clone and loaded by path (``runpy``, ``importlib``).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Any, Callable, Optional, Sequence

from PIL import Image, UnidentifiedImageError

from mmssl.checkpoints import UnsafeCheckpointError
from mmssl.data.decode import DEFAULT_MAX_IMAGE_PIXELS

# What a tool reports in one line and exit 1, instead of a traceback: bad or missing input files
# (OSError: FileNotFoundError, FileExistsError, IsADirectoryError, ...), bad values (ValueError),
# a checkpoint or file lacking a key (KeyError; mmssl's carry a message naming the file and key),
# a checkpoint that pickles code.
EXPECTED_FAILURES: tuple[type[BaseException], ...] = (OSError, ValueError, KeyError, UnsafeCheckpointError)


def add_option(parser: argparse.ArgumentParser, name: str, *old: str, required: bool = False,
               **kwargs: Any) -> None:
    """Add option ``name``; each spelling in ``old`` is accepted too, hidden from ``--help``.

    The new option's help says which old spellings still work. A required option with aliases is a
    required mutually exclusive group, so either spelling satisfies it and giving both is an error.

    Args:
        parser: the tool's parser.
        name: the option (``--images``).
        *old: deprecated spellings (``--image``).
        required: one of the spellings must be given.
        **kwargs: ``add_argument``'s other arguments (``help``, ``nargs``, ``type``, ``action``...).
    """
    if not old:
        parser.add_argument(name, required=required, **kwargs)
        return
    group = parser.add_mutually_exclusive_group(required=required)
    help_text = kwargs.pop("help", "") or ""
    note = f"({', '.join(old)}: the old spelling{'s' if len(old) > 1 else ''}, deprecated, still accepted)"
    action = group.add_argument(name, help=f"{help_text} {note}".strip(), **kwargs)
    for spelling in old:
        group.add_argument(spelling, dest=action.dest, help=argparse.SUPPRESS, **kwargs)


def add_images(parser: argparse.ArgumentParser, *old: str, help: str = "image files (one or many)") -> None:
    """``--images PATH [PATH ...]``, required."""
    add_option(parser, "--images", *old, required=True, nargs="+", metavar="IMAGE", help=help)


def add_output_json(parser: argparse.ArgumentParser, *old: str, help: str = "write the results here as JSON") -> None:
    """``--output-json FILE``, optional."""
    add_option(parser, "--output-json", *old, metavar="FILE", help=help)


def add_loader_arguments(parser: argparse.ArgumentParser, batch_size: Optional[int] = 256, num_workers: int = 0,
                         old_workers: tuple[str, ...] = (), batch_help: str = "images per batch",
                         workers_help: str = "data loader worker processes") -> None:
    """``--batch-size`` and ``--num-workers``.

    Args:
        parser: the tool's parser.
        batch_size: its default (``None``: required).
        num_workers: its default.
        old_workers: deprecated spellings of ``--num-workers`` (``--workers``).
        batch_help: help of ``--batch-size``.
        workers_help: help of ``--num-workers``.
    """
    parser.add_argument("--batch-size", type=int, default=batch_size, required=batch_size is None, help=batch_help)
    add_option(parser, "--num-workers", *old_workers, type=int, default=num_workers, help=workers_help)


def check_images(paths: Sequence[str], max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, option: str = "--images") -> None:
    """Refuse image files before any is decoded: missing, unreadable, or larger than training decodes.

    Only each header is read. The limit is the data pipeline's
    (:data:`mmssl.data.decode.DEFAULT_MAX_IMAGE_PIXELS`): a larger image would cost gigabytes to
    decode for a model input of a few hundred pixels, and one above twice it is refused by PIL with
    a ``DecompressionBombError`` that is no ``OSError``.

    Raises:
        FileNotFoundError: no file at a path.
        ValueError: a file that is not an image, or larger than ``max_pixels``, naming it and its size.
    """
    for path in paths:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{option}: no image file at {path!r}")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the check below names the file
                with Image.open(path) as image:
                    width, height = image.size
        except Image.DecompressionBombError as err:
            raise ValueError(f"{option}: {path!r} is too large to decode ({err})") from None
        except (UnidentifiedImageError, OSError) as err:
            raise ValueError(f"{option}: {path!r} is not a readable image ({err})") from None
        if width * height > max_pixels:
            raise ValueError(f"{option}: {path!r} is {width} x {height} pixels, above the {max_pixels} that mmssl "
                             "decodes (training skips such images): resize it first")


def output_names(paths: list[str], suffix: str) -> list[str]:
    """One output file name per input image: its stem plus ``suffix``, or, where two inputs share
    a stem (``a/x.jpg``, ``b/x.jpg``), its path relative to the inputs' common folder.

    Raises:
        ValueError: two inputs would still write one file (``x.jpg`` and ``x.png``), naming both.
    """
    stems = [os.path.splitext(os.path.basename(p))[0] for p in paths]
    if len(set(stems)) == len(stems):
        return [stem + suffix for stem in stems]
    absolute = [os.path.abspath(p) for p in paths]
    common = os.path.commonpath([os.path.dirname(a) for a in absolute])
    names = [os.path.splitext(os.path.relpath(a, common))[0] + suffix for a in absolute]
    first: dict[str, str] = {}
    for path, name in zip(paths, names):
        if name in first:
            raise ValueError(f"--images {first[name]!r} and {path!r} would both be written to {name!r}: "
                             "rename one, or run them separately")
        first[name] = path
    return names


def describe(err: BaseException) -> str:
    """One line for an expected failure: the file (an OSError's filename) or key, and what is wrong."""
    if isinstance(err, OSError) and err.filename is not None:
        text = f"{err.filename}: {err.strerror or err}"
    elif isinstance(err, KeyError) and len(err.args) == 1 and isinstance(err.args[0], str) and " " in err.args[0]:
        text = err.args[0]  # mmssl's KeyErrors are sentences; str() would quote them
    elif isinstance(err, KeyError):
        text = f"missing key {err}"
    else:
        text = str(err) or type(err).__name__
    return " ".join(text.split())


def run(name: str, body: Callable[[], Optional[int]]) -> int:
    """Run a tool's body; its exit status.

    Args:
        name: the tool (``zero_shot``), the start of a failure's line.
        body: the work after parsing; returns an exit status, or ``None`` for 0.

    Returns:
        ``body``'s status (0 for ``None``), or 1 after one line ``NAME: FILE-or-KEY: what`` on stderr
        for an expected failure (:data:`EXPECTED_FAILURES`, or an optional dependency missing,
        :func:`is_missing_extra`); anything else propagates (a bug's traceback).
    """
    try:
        status = body()
    except EXPECTED_FAILURES as err:
        print(f"{name}: {describe(err)}", file=sys.stderr)
        return 1
    except ImportError as err:
        if not is_missing_extra(err):
            raise  # a broken installation or a bug: its traceback
        print(f"{name}: {describe(err)}", file=sys.stderr)
        return 1
    return 0 if status is None else int(status)


def is_missing_extra(err: ImportError) -> bool:
    """Whether ``err`` is mmssl's sentence for an optional dependency that is not installed (peft
    for a LoRA checkpoint, transformers for a Hugging Face folder): it says what to install."""
    return "pip install" in str(err)
