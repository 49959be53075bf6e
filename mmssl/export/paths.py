"""Where an export may write: checked before anything is read or written, then written through a
temporary file or folder beside the target, so a refused or failed export leaves ``output`` as it was.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
from typing import IO, Callable, Optional

import torch

StateDict = dict[str, torch.Tensor]

# The files the folder formats write (timm's save_for_hf; open_clip's hub files; transformers'
# CLIPModel, processor and tokenizer). ``--overwrite`` replaces a folder holding only these, so
# that it never deletes a file an export did not write.
EXPORT_FILE_NAMES = frozenset({
    "config.json", "model.safetensors", "open_clip_config.json", "open_clip_model.safetensors",
    "preprocessor_config.json", "processor_config.json", "tokenizer_config.json", "special_tokens_map.json",
    "vocab.json", "merges.txt", "tokenizer.json", "generation_config.json", "chat_template.jinja", "README.md",
    "spiece.model", "tokenizer.model", "added_tokens.json",  # SentencePiece tokenizers (SigLIP)
})


def check_output(output: str, folder: bool, overwrite: bool = False) -> None:
    """Refuse an export destination before anything is read or written.

    Args:
        output: the file or folder to write.
        folder: the format writes a folder (else one state-dict file).
        overwrite: replace an existing file, or a folder holding only :data:`EXPORT_FILE_NAMES`.

    Raises:
        FileExistsError: ``output`` exists (a file, or a non-empty folder) and ``overwrite`` is off,
            or it holds files no export writes.
        IsADirectoryError / NotADirectoryError: a folder where a file goes, or the other way round.
    """
    parent = os.path.dirname(os.path.abspath(output))
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise NotADirectoryError(f"--output {output!r}: {parent!r} is a file, not a folder")
    if not folder:
        if os.path.isdir(output) or output.endswith(("/", os.sep)):
            raise IsADirectoryError(f"--output {output!r} is a folder; this format writes one state-dict file "
                                    "(name a .pth or .safetensors file)")
        if os.path.lexists(output) and not overwrite:
            raise FileExistsError(f"--output {output!r} exists: pass --overwrite to replace it")
        return
    if os.path.lexists(output) and not os.path.isdir(output):
        raise NotADirectoryError(f"--output {output!r} is a file; this format writes a folder")
    entries = sorted(os.listdir(output)) if os.path.isdir(output) else []
    if not entries:
        return
    if not overwrite:
        raise FileExistsError(f"--output {output!r} is a folder that is not empty ({', '.join(entries[:5])}"
                              f"{' ...' if len(entries) > 5 else ''}): name a new or empty folder, or pass --overwrite")
    foreign = [e for e in entries if e not in EXPORT_FILE_NAMES or not os.path.isfile(os.path.join(output, e))]
    if foreign:
        raise FileExistsError(f"--output {output!r} holds {foreign[:5]}, which no export writes: --overwrite "
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


class _RecordingFile:
    """A binary file that remembers the ``OSError`` of a failed write: ``torch.save`` turns it into
    a ``RuntimeError`` without the errno ("unexpected pos", "file write failed")."""

    def __init__(self, file: IO[bytes]) -> None:
        self.file, self.error = file, None

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        self.file.flush()


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
    kept = f"the earlier {kind} there is unchanged" if os.path.lexists(output) else f"no {kind} was written"
    return OSError(code, f"could not write it ({os.strerror(code)}); {kept}, and no partial one is left", output)


def save_state_file(state: StateDict, output: str) -> None:
    """Save a state dict to ``output`` through a temporary file beside it, then ``os.replace``
    (a failed write leaves an existing file whole). ``.safetensors`` by suffix, else ``torch.save``.

    Raises:
        OSError: the medium refused the write (full disk, quota): one error naming ``output`` and
            the cause (:func:`write_failed`); no temporary file is left.
    """
    folder = os.path.dirname(os.path.abspath(output))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(output)}.", suffix=".tmp", dir=folder)
    recorder = None
    try:
        if output.endswith(".safetensors"):
            os.close(fd)
            from safetensors.torch import save_file

            save_file(state, tmp)
        else:
            with os.fdopen(fd, "wb") as file:
                recorder = _RecordingFile(file)
                torch.save(state, recorder)
        _umask_mode(tmp, folder=False)
        os.replace(tmp, output)
    except BaseException as err:
        os.unlink(tmp)
        failed = write_failed(output, recorder.error if recorder and recorder.error else err, "file")
        if failed is not None:
            raise failed from err
        raise


def write_folder(output: str, write: Callable[[str], StateDict]) -> StateDict:
    """Run ``write`` into a new folder beside ``output``, then put it in ``output``'s place (an
    earlier export there, checked by :func:`check_output`, is removed only once the new one is whole).

    Returns:
        What ``write`` returns.

    Raises:
        OSError: the medium refused a write (full disk, quota): one error naming ``output`` and the
            cause (:func:`write_failed`); the new folder is removed, ``output`` left as it was.
    """
    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.normpath(output))}.", dir=parent)
    try:
        state = write(tmp)
        _umask_mode(tmp, folder=True)
        if os.path.isdir(output) and os.listdir(output):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.normpath(output))}.old.", dir=parent)
            os.replace(output, old)  # onto the empty folder just made
            os.replace(tmp, output)
            shutil.rmtree(old)
        else:
            os.replace(tmp, output)  # an empty folder at output is replaced
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        failed = write_failed(output, err, "folder")
        if failed is not None:
            raise failed from err
        raise
    return state
