"""Checkpoint files written atomically on any file system: the old file stays whole until the new one is.

Lightning's ``TorchCheckpointIO`` saves through an fsspec transaction; for a local path fsspec
writes a temporary file with ``tempfile.mkstemp()`` (in ``$TMPDIR``) and moves it over the
target with ``shutil.move``. When the run folder is on another mount than ``$TMPDIR`` (a shared
scratch, NFS, Lustre, a tmpfs) the rename fails with ``EXDEV`` and the move falls back to
copying into the target, truncated first: a kill or a full disk during that copy leaves a
partial ``last.ckpt`` in place of the previous good one, and a full ``$TMPDIR`` stops
checkpointing even where the run folder has room.

:class:`AtomicCheckpointIO` writes the temporary file in the target's own folder (so the final
rename never crosses a device), flushes and fsyncs it, ``os.replace``-s it over the target and
fsyncs the folder: the target is either the previous file or the new one, whole, at any moment
of a kill, a power cut or a write error. Paths of other fsspec file systems get a temporary
object beside the target, moved over it once completely written.
"""

from __future__ import annotations

import contextlib
import glob
import io
import os
import re
import secrets
import shutil
import socket
from pathlib import Path
from typing import Any, Optional, Union

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins import TorchCheckpointIO

_HOST = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "host"
PARTIAL, OLD = ".partial", ".old"  # a sharded folder being written; a checkpoint set aside by a replace
_OLD_FORMAT_END = "ckpt"  # the field before the pid in a hidden name without the host (writer_alive)


def hidden_name(path: Union[str, os.PathLike], suffix: str) -> Path:
    """``.{name}.{host}.{pid}.{random}{suffix}`` beside ``path``: outside every ``*.ckpt`` listing,
    and naming the process that made it (:func:`writer_alive`)."""
    path = Path(path)
    return path.with_name(f".{path.name}.{_HOST}.{os.getpid()}.{secrets.token_hex(4)}{suffix}")


def writer_alive(hidden: Union[str, os.PathLike]) -> bool:
    """Whether the process named in a :func:`hidden_name` may still be writing it: ``True`` for a
    live process of this host other than this one, or a name of another host (whose processes
    cannot be asked); ``False`` for this process (one save at a time) or a dead process here.

    A name of the format before the host was added, ``.{name}.{pid}.{random}{suffix}`` (folders
    that kills left then), is read as this host's: its field before the pid is the end of the
    checkpoint's name (``ckpt``: Lightning's checkpoints all end in ``.ckpt``), never a host."""
    parts = Path(hidden).name.split(".")
    if len(parts) < 4 or not parts[-3].isdigit():
        return True  # not a name this module made: left alone
    host, pid = parts[-4], int(parts[-3])
    if host != _HOST and not (host == _OLD_FORMAT_END and len(parts) >= 6):
        return True
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # alive, owned by another user
        return True
    return True


def set_aside_paths(path: Union[str, os.PathLike]) -> list[Path]:
    """Complete checkpoints (files or folders) that a replace set aside beside ``path`` and a kill
    left there, newest first: :mod:`mmssl.checkpoints.resume` lists them as resume candidates."""
    path = Path(path)
    pattern = os.path.join(glob.escape(str(path.parent)), f".{glob.escape(path.name)}.*{OLD}")
    found = []
    for p in glob.glob(pattern):
        with contextlib.suppress(OSError):
            found.append((os.stat(p).st_mtime, Path(p)))
    return [p for _, p in sorted(found, reverse=True)]


def remove_path(path: Union[str, os.PathLike]) -> None:
    """Remove a file or a folder; nothing if it is gone."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)


def replace_path(temp: Union[str, os.PathLike], path: Union[str, os.PathLike]) -> None:
    """Rename the complete checkpoint ``temp`` (a file or a folder) to ``path``, whatever is there.

    A file over a file is one ``os.replace``. A folder, or anything over a folder, cannot be
    renamed over in one step: the previous checkpoint is first set aside under a hidden
    :data:`OLD` name (a resume candidate, :func:`set_aside_paths`), so that a kill between the two
    renames still leaves it whole; it is removed once ``temp`` bears the name, with what earlier
    kills set aside.
    """
    temp, path = str(temp), str(path)
    old = None
    if os.path.isdir(path) or (os.path.lexists(path) and os.path.isdir(temp)):
        old = hidden_name(path, OLD)
        os.rename(path, old)
    if old is None and os.path.lexists(path):
        os.replace(temp, path)
    else:
        os.rename(temp, path)
    fsync_folder(os.path.dirname(os.path.abspath(path)))
    for stale in ([old] if old else []) + set_aside_paths(path):
        remove_path(stale)


def _temp_name(path: str) -> str:
    """``.{name}.{host}.{pid}.{random}.tmp`` beside ``path``: hidden, and outside the
    ``last*.ckpt`` / ``*.ckpt`` patterns that Lightning and :mod:`mmssl.checkpoints.resume` list."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.{_HOST}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def _remove_stale_temps(path: str) -> None:
    """Delete the temporary files that killed writers on this host left beside ``path``."""
    folder, name = os.path.split(path)
    for temp in glob.glob(os.path.join(glob.escape(folder), f".{glob.escape(name)}.{_HOST}.*.tmp")):
        pid = temp[: -len(".tmp")].split(".")[-2]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:  # its writer is gone
            with contextlib.suppress(OSError):
                os.unlink(temp)
        except OSError:  # alive, owned by another user
            pass


def fsync_folder(folder: str) -> None:
    """Make a rename in ``folder`` durable; a no-op where folders cannot be opened or synced."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # EINVAL on file systems that do not sync folders
        pass
    finally:
        os.close(fd)


class WriteRecorder:
    """A binary file that keeps the ``OSError`` of its first failed write: ``torch.save`` reports
    one as a ``RuntimeError`` without the errno ("unexpected pos ...", "file write failed") when
    nothing is left for the file's close to fail on. Checkpoint saves and exports both wrap theirs."""

    def __init__(self, file: Any) -> None:
        self.file, self.error = file, None

    def write(self, data: Any) -> int:
        try:
            return self.file.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        self.file.flush()


def atomic_torch_save(obj: Any, path: str) -> None:
    """``torch.save(obj, path)`` so that ``path`` is at every moment the old file or the new one, whole.

    Args:
        obj: anything ``torch.save`` accepts (a Lightning checkpoint dict).
        path: a local file path; its folder is created if needed.

    Raises:
        OSError: the file could not be written (full disk, quota, I/O error), naming ``path``;
            the previous file at ``path``, if any, is unchanged and no temporary file is left.
    """
    path = os.path.abspath(path)
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    temp = _temp_name(path)
    recorder = None
    try:
        # os.open with 0o666 (not mkstemp's 0o600): the file gets the umask's permissions, as
        # a plain open() would give it, so a group sharing the run folder can read it.
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        with os.fdopen(fd, "wb") as file:
            recorder = WriteRecorder(file)
            torch.save(obj, recorder)
            file.flush()
            os.fsync(file.fileno())
        replace_path(temp, path)  # a folder there too: a sharded run's checkpoint, resumed on one device
    except BaseException as raised:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        err = recorder.error if recorder is not None and recorder.error is not None else raised
        if isinstance(err, OSError) and err.errno is not None:
            raise OSError(err.errno, f"could not write checkpoint {path} ({os.strerror(err.errno)}); "
                          "the previous file there, if any, is unchanged") from raised
        raise
    _remove_stale_temps(path)


def _save_fsspec(fs: fsspec.AbstractFileSystem, obj: Any, path: str) -> None:
    """Write ``obj`` to a temporary object beside ``path`` on ``fs``, then move it over ``path``."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    parent, _, name = path.rstrip("/").rpartition("/")
    if parent:
        fs.makedirs(parent, exist_ok=True)
    temp = f"{parent}/.{name}.{secrets.token_hex(8)}.tmp" if parent else f".{name}.{secrets.token_hex(8)}.tmp"
    try:
        with fs.open(temp, "wb") as file:
            file.write(buffer.getbuffer())
        fs.mv(temp, path)
    except BaseException:
        with contextlib.suppress(Exception):
            fs.rm(temp)
        raise


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose saves replace the target atomically, on any mount.

    Local paths (and ``file://`` URLs) go through :func:`atomic_torch_save`; other fsspec URLs
    are written to a temporary object in the target's folder and moved over it. Loading and
    removal are Lightning's. ``mmssl fit`` installs it unless the config names its own
    ``CheckpointIO`` (in ``trainer.plugins`` or the strategy's ``checkpoint_io``).
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Union[str, os.PathLike],
                        storage_options: Optional[Any] = None) -> None:
        """Save ``checkpoint`` to ``path``, replacing any file there only once the new one is whole.

        Args:
            checkpoint: the state Lightning dumps.
            path: the target file: a local path or an fsspec URL.
            storage_options: not supported (as in ``TorchCheckpointIO``).

        Raises:
            TypeError: ``storage_options`` was given.
            OSError: the write failed; the previous file is unchanged.
        """
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options, got {storage_options!r}")
        fs, target = fsspec.core.url_to_fs(str(path))
        if isinstance(fs, LocalFileSystem):
            atomic_torch_save(checkpoint, target)
        else:
            _save_fsspec(fs, checkpoint, target)


__all__ = ["OLD", "PARTIAL", "AtomicCheckpointIO", "atomic_torch_save", "hidden_name", "remove_path", "replace_path",
           "set_aside_paths", "writer_alive"]
