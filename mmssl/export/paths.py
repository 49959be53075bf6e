"""Where an export may write: checked before anything is read or written, then written through a
temporary file or folder beside the target, so a refused or failed export leaves ``output`` as it was.

An ``output`` that is a symbolic link (to a file, a folder, or nothing yet) is written where it
points, and the link stays: a shared ``exports/latest -> /big/disk/clip_v3`` is a place to write.
An earlier export folder is replaced in one step where the system can exchange two paths
(Linux ``renameat2(RENAME_EXCHANGE)``), so no moment leaves ``output`` missing.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import re
import shutil
import sys
import tempfile
from typing import Callable, Optional

import torch

from mmssl.checkpoints.io import WriteRecorder
from mmssl.checkpoints.layouts import StateDict

# The files the folder formats write (timm's save_for_hf; open_clip's hub files; transformers'
# CLIPModel, processor and tokenizer). ``--overwrite`` replaces a folder holding only these, so
# that it never deletes a file an export did not write.
EXPORT_FILE_NAMES = frozenset({
    "config.json", "model.safetensors", "open_clip_config.json", "open_clip_model.safetensors",
    "preprocessor_config.json", "processor_config.json", "tokenizer_config.json", "special_tokens_map.json",
    "vocab.json", "merges.txt", "tokenizer.json", "generation_config.json", "chat_template.jinja", "README.md",
    "spiece.model", "tokenizer.model", "added_tokens.json",  # SentencePiece tokenizers (SigLIP)
})


def resolve_link(output: str) -> str:
    """Where ``output`` points when it is a symbolic link (through every link of a chain, to a
    path that need not exist yet); ``output`` itself otherwise."""
    return os.path.realpath(output) if os.path.islink(output) else output


def _named(output: str) -> str:
    """``'OUTPUT'``, and where it points when it is a link, for messages."""
    target = resolve_link(output)
    return f"{output!r}" + (f" (a link to {target!r})" if target != output else "")


def check_output(output: str, folder: bool, overwrite: bool = False) -> None:
    """Refuse an export destination before anything is read or written.

    Args:
        output: the file or folder to write (a link: where it points, :func:`resolve_link`).
        folder: the format writes a folder (else one state-dict file).
        overwrite: replace an existing file, or a folder holding only :data:`EXPORT_FILE_NAMES`.

    Raises:
        FileExistsError: ``output`` exists (a file, or a non-empty folder) and ``overwrite`` is off,
            or it holds files no export writes.
        IsADirectoryError / NotADirectoryError: a folder where a file goes, or the other way round.
    """
    named, target = _named(output), resolve_link(output)
    parent = os.path.dirname(os.path.abspath(target))
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise NotADirectoryError(f"--output {named}: {parent!r} is a file, not a folder")
    if not folder:
        if os.path.isdir(target) or output.endswith(("/", os.sep)):
            raise IsADirectoryError(f"--output {named} is a folder; this format writes one state-dict file "
                                    "(name a .pth or .safetensors file)")
        if os.path.lexists(target) and not overwrite:
            raise FileExistsError(f"--output {named} exists: pass --overwrite to replace it")
        return
    if os.path.lexists(target) and not os.path.isdir(target):
        raise NotADirectoryError(f"--output {named} is a file; this format writes a folder")
    entries = sorted(os.listdir(target)) if os.path.isdir(target) else []
    if not entries:
        return
    if not overwrite:
        raise FileExistsError(f"--output {named} is a folder that is not empty ({', '.join(entries[:5])}"
                              f"{' ...' if len(entries) > 5 else ''}): name a new or empty folder, or pass --overwrite")
    foreign = [e for e in entries if e not in EXPORT_FILE_NAMES or not os.path.isfile(os.path.join(target, e))]
    if foreign:
        raise FileExistsError(f"--output {named} holds {foreign[:5]}, which no export writes: --overwrite "
                              "replaces only a folder of an earlier export; name a new or empty folder")


def _umask_mode(path: str, folder: bool) -> None:
    """Give a temporary file or folder (created 0600 / 0700) the mode a plain ``open`` / ``mkdir``
    would have given it under the process's umask."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, (0o777 if folder else 0o666) & ~mask)


# The errors of a write that the medium refused (full disk, quota, file too large, read-only
# mount): reported as a failure to write the output, not as whatever library was writing.
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})


def _write_errno(err: BaseException) -> Optional[int]:
    """The errno of a refused write in ``err`` or its causes, if one of :data:`WRITE_ERRNOS`
    (safetensors' Rust errors carry it only in their text, ``(os error 28)``)."""
    seen = 0
    while err is not None and seen < 8:
        code = err.errno if isinstance(err, OSError) else None
        if code is None and (found := re.search(r"\(os error (\d+)\)", str(err))):
            code = int(found.group(1))
        if code in WRITE_ERRNOS:
            return code
        err, seen = err.__cause__ or err.__context__, seen + 1
    return None


def write_failed(output: str, err: BaseException, kind: str = "file") -> Optional[OSError]:
    """The one error for a write of ``output`` that the medium refused, or ``None`` for any other error.

    Args:
        output: the file or folder the user named.
        err: what the writer raised.
        kind: ``file`` or ``folder``, for the message.

    Returns:
        ``OSError(errno, "could not write it (CAUSE); ...", output)``, saying that an earlier
        ``kind`` there is unchanged, or that none was written, and that no partial one is left.
    """
    code = _write_errno(err)
    if code is None:
        return None
    kept = f"the earlier {kind} there is unchanged" if os.path.exists(output) else f"no {kind} was written"
    return OSError(code, f"could not write it ({os.strerror(code)}); {kept}, and no partial one is left", output)


def save_state_file(state: StateDict, output: str) -> None:
    """Save a state dict to ``output`` through a temporary file beside it, then ``os.replace``
    (a failed write leaves an existing file whole). ``.safetensors`` by suffix, else ``torch.save``.

    Raises:
        OSError: the medium refused the write (full disk, quota): one error naming ``output`` and
            the cause (:func:`write_failed`); no temporary file is left.
    """
    named, output = output, resolve_link(output)
    folder = os.path.dirname(os.path.abspath(output))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(output)}.", suffix=".tmp", dir=folder)
    recorder = None
    try:
        if named.endswith(".safetensors"):
            os.close(fd)
            from safetensors.torch import save_file

            save_file(state, tmp)
        else:
            with os.fdopen(fd, "wb") as file:
                recorder = WriteRecorder(file)
                torch.save(state, recorder)
        _umask_mode(tmp, folder=False)
        os.replace(tmp, output)
    except BaseException as err:
        os.unlink(tmp)
        failed = write_failed(named, recorder.error if recorder and recorder.error else err, "file")
        if failed is not None:
            raise failed from err
        raise


RENAME_EXCHANGE, AT_FDCWD = 2, -100  # <linux/fs.h>, <fcntl.h>


@functools.lru_cache(maxsize=1)
def _renameat2() -> Optional[Callable[..., int]]:
    """glibc's ``renameat2`` (2.28+), or ``None`` off Linux or where the C library lacks it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def exchange(a: str, b: str) -> bool:
    """Swap two existing paths in one step (rename(2), ``RENAME_EXCHANGE``).

    Returns:
        ``False`` where the system or the file system cannot (nothing was changed then).

    Raises:
        OSError: the exchange failed for another reason, naming both paths.
    """
    fn = _renameat2()
    if fn is None:
        return False
    if fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # no such flag or file-system support
        return False
    raise OSError(code, os.strerror(code), a, None, b)


def _swap_in(new: str, output: str) -> None:
    """Put folder ``new`` in the place of folder ``output``; ``new`` then holds what ``output`` held.

    In one step where :func:`exchange` can; else in two renames, ``output`` set aside as a hidden
    ``.NAME.old.*`` folder beside it in between (put back if the second rename fails; a kill there
    leaves it set aside, which ``mmssl.data.teacher_embeddings`` names).
    """
    if exchange(new, output):
        return
    parent, name = os.path.split(os.path.normpath(os.path.abspath(output)))
    old = tempfile.mkdtemp(prefix=f".{name}.old.", dir=parent)
    try:
        os.replace(output, old)  # onto the empty folder just made
    except BaseException:
        os.rmdir(old)
        raise
    try:
        os.replace(new, output)
    except BaseException:
        os.replace(old, output)
        raise
    os.replace(old, new)  # ``new`` was moved away: its name is free


def write_folder(output: str, write: Callable[[str], StateDict]) -> StateDict:
    """Run ``write`` into a new folder beside ``output``, then put it in ``output``'s place (an
    earlier export there, checked by :func:`check_output`, is removed only once the new one is in
    its place; a link is written where it points, :func:`resolve_link`).

    Returns:
        What ``write`` returns.

    Raises:
        OSError: the medium refused a write (full disk, quota): one error naming ``output`` and the
            cause (:func:`write_failed`); the new folder is removed, ``output`` left as it was.
    """
    named, output = output, resolve_link(output)
    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.normpath(output))}.", dir=parent)
    try:
        state = write(tmp)
        _umask_mode(tmp, folder=True)
        if os.path.isdir(output) and os.listdir(output):
            _swap_in(tmp, output)
            shutil.rmtree(tmp)  # the earlier export
        else:
            os.replace(tmp, output)  # an empty folder at output is replaced
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        failed = write_failed(named, err, "folder")
        if failed is not None:
            raise failed from err
        raise
    return state
