"""A kill or a full disk while a checkpoint is written leaves the previous file whole, on any mount.

The faults are real: strace kills the process, or fails its writes with ENOSPC, at the system
call that carries the checkpoint's bytes to its file. Lightning's own save copies a temporary file
from ``$TMPDIR`` into the target with ``sendfile`` when the two are on different mounts; mmssl's
writes the temporary file beside the target and fsyncs it before the rename. Each test injects
the fault at both, so that whichever code writes, the fault lands mid-save.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.plugins.io import TorchCheckpointIO

from mmssl.checkpoints import read_checkpoint
from mmssl.checkpoints.io import AtomicCheckpointIO, atomic_torch_save
from mmssl.checkpoints.sharded import SafeCheckpointIO
from mmssl.cli import MMSSLCLI, main
from tests.checkpoints.test_run_folders import loss_steps, tiny_config
from tests.cli_runs import cli_env


def _strace() -> str:
    path = shutil.which("strace")
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("strace is not installed: CI must run these tests (.ci/run installs it)")
        pytest.skip("strace is not installed (apt-get install strace): the fault-injection tests need it")
    return path


# Python that imports ``module``, stops itself for strace to attach, then runs ``code`` with
# ``sys.argv[1:]``: the fault injection starts after the imports, which run at full speed.
_BOOT = "import os, signal, sys; import {module}; os.kill(os.getpid(), signal.SIGSTOP); {code}"
_AS_MMSSL = "import runpy; sys.argv[0] = 'mmssl'; runpy.run_module('mmssl', run_name='__main__', alter_sys=True)"


def _proc_field(pid: int, field: str) -> str:
    with open(f"/proc/{pid}/status") as status:
        return next(line.split()[1] for line in status if line.startswith(field + ":"))


def _under_strace(strace_args: list[str], module: str, code: str, args: list[str], env: dict, timeout: float,
                  cwd: Path) -> subprocess.CompletedProcess:
    """Run ``code`` (after ``import module``) in a fresh Python under ``strace STRACE_ARGS -p PID``."""
    boot = _BOOT.format(module=module, code=code)
    proc = subprocess.Popen([sys.executable, "-c", boot, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    tracer = None
    try:
        deadline = time.monotonic() + timeout
        while proc.poll() is None and _proc_field(proc.pid, "State") != "T":
            assert time.monotonic() < deadline, "the traced process never stopped for strace"
            time.sleep(0.05)
        tracer = subprocess.Popen([_strace(), "-qq", "-o", os.devnull, *strace_args, "-p", str(proc.pid)])
        while proc.poll() is None and _proc_field(proc.pid, "TracerPid") == "0":
            assert tracer.poll() is None, "strace could not attach (ptrace not permitted?)"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGCONT)
        out = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
    finally:
        for p in (proc, tracer):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


@pytest.fixture
def other_mount(tmp_path):
    """A folder on another file system than ``tmp_path`` (the ``$TMPDIR`` the runs get): /dev/shm."""
    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on another mount than the test's temporary folder")
    folder = Path(tempfile.mkdtemp(prefix="mmssl-test-", dir="/dev/shm"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_a_kill_while_last_ckpt_is_written_keeps_the_previous_one_and_last_resumes_from_the_newest(
        tmp_path, tiny_demo, other_mount, capsys):
    _strace()
    root = other_mount / "runs"
    config = tiny_config(tmp_path, tiny_demo.root, max_steps=6)
    # Saves: step=2, last(2), step=4, last(4), ...: the 4th (last.ckpt at step 4) is killed mid-write,
    # at its 7th sendfile (Lightning: 2 per copy) or 7th fsync (mmssl: file then folder, 2 per save).
    killed = _under_strace(
        ["-f", "-e", "trace=sendfile,fsync", "-e", "inject=sendfile:signal=SIGKILL:when=7",
         "-e", "inject=fsync:signal=SIGKILL:when=7"], "mmssl.cli", _AS_MMSSL,
        ["fit", "--config", config, f"--trainer.default_root_dir={root}"],
        cli_env(TMPDIR=str(tmp_path)), timeout=300, cwd=tmp_path)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:]
    ckpts = root / "version_0" / "checkpoints"
    assert read_checkpoint(str(ckpts / "last.ckpt"))["global_step"] == 2  # the previous one, whole
    assert read_checkpoint(str(ckpts / "epoch=0-step=4.ckpt"))["global_step"] == 4

    capsys.readouterr()
    main(["fit", "--config", config, f"--trainer.default_root_dir={root}", "--ckpt_path=last"])
    said = capsys.readouterr().err
    assert f"resuming from {ckpts / 'epoch=0-step=4.ckpt'} (global_step 4), continuing {root / 'version_0'}" in said
    assert sorted(p.name for p in root.iterdir()) == ["version_0"]  # continued in its folder
    assert read_checkpoint(str(ckpts / "last.ckpt"))["global_step"] == 6
    assert set(loss_steps(root / "version_0")) >= {4, 5} and max(loss_steps(root / "version_0").values()) == 1
    assert not list(ckpts.glob(".*.tmp"))  # the killed writer's temporary file is cleaned up


def _fork_under_strace(strace_args: list[str], fn, timeout: float = 60) -> int:
    """Run ``fn()`` in a fork of this process under ``strace STRACE_ARGS -p PID``; its exit status.

    The fork stops itself until strace has attached, so the faults hit ``fn`` alone (and no
    second interpreter pays the imports)."""
    pid = os.fork()
    if pid == 0:  # the child: stop, then run fn, and leave without pytest's clean-up
        code = 1
        try:
            os.kill(os.getpid(), signal.SIGSTOP)
            fn()
            code = 0
        finally:
            os._exit(code)
    tracer = None
    try:
        deadline = time.monotonic() + timeout
        while _proc_field(pid, "State") != "T":
            assert time.monotonic() < deadline, "the forked process never stopped for strace"
            time.sleep(0.01)
        tracer = subprocess.Popen([_strace(), "-qq", "-o", os.devnull, *strace_args, "-p", str(pid)])
        while _proc_field(pid, "TracerPid") == "0":
            assert tracer.poll() is None, "strace could not attach (ptrace not permitted?)"
            time.sleep(0.01)
        os.kill(pid, signal.SIGCONT)
        _, status = os.waitpid(pid, 0)
        tracer.wait(timeout=timeout)
        return os.waitstatus_to_exitcode(status)
    finally:
        if tracer is not None and tracer.poll() is None:
            tracer.kill()
        with contextlib.suppress(ChildProcessError, ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def test_a_full_disk_while_writing_keeps_the_previous_file(tmp_path, other_mount, monkeypatch):
    _strace()
    target = other_mount / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"global_step": 1, "w": torch.zeros(3)}, str(target))
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # another mount than the target's
    monkeypatch.setattr(tempfile, "tempdir", None)
    assert tempfile.gettempdir() == str(tmp_path)  # looked up (with a test write) before the fork
    bigger = {"global_step": 2, "w": torch.ones(300_000)}
    # The disk is full from the save's 2nd write on (mmssl writes the file in 4, Lightning in 1
    # and then copies it with sendfile).
    code = _fork_under_strace(["-e", "trace=write,sendfile", "-e", "inject=write:error=ENOSPC:when=2+",
                               "-e", "inject=sendfile:error=ENOSPC"],
                              lambda: AtomicCheckpointIO().save_checkpoint(bigger, str(target)))
    assert code == 1  # the save failed
    assert read_checkpoint(str(target))["global_step"] == 1
    assert sorted(os.listdir(other_mount)) == ["last.ckpt"]  # no temporary file left behind


def test_a_write_error_names_the_file_and_keeps_it(tmp_path, monkeypatch):
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_last=True, save_top_k=0)
    quiet = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}
    pl.Trainer(max_steps=2, callbacks=[ckpt], plugins=[AtomicCheckpointIO()], **quiet).fit(BoringModel())
    last = tmp_path / "last.ckpt"
    good = read_checkpoint(str(last))

    def disk_full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", disk_full)
    trainer = pl.Trainer(max_steps=4, callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2,
                         save_last=True, save_top_k=0)], plugins=[AtomicCheckpointIO()], **quiet)
    with pytest.raises(OSError, match=rf"could not write checkpoint {last} \(No space left on device\)"):
        trainer.fit(BoringModel(), ckpt_path=str(last))
    monkeypatch.undo()
    after = read_checkpoint(str(last))
    assert after["global_step"] == 2 and sorted(os.listdir(tmp_path)) == ["last.ckpt"]
    assert all(torch.equal(after["state_dict"][k], v) for k, v in good["state_dict"].items())


def test_saves_need_no_room_in_tmpdir_and_fsspec_urls_are_replaced_whole(tmp_path, monkeypatch):
    unusable = tmp_path / "not-a-folder"
    unusable.write_text("")
    monkeypatch.setattr(tempfile, "tempdir", str(unusable))  # $TMPDIR full or gone
    AtomicCheckpointIO().save_checkpoint({"global_step": 3}, str(tmp_path / "a" / "last.ckpt"))
    assert read_checkpoint(str(tmp_path / "a" / "last.ckpt"))["global_step"] == 3
    AtomicCheckpointIO().save_checkpoint({"global_step": 4}, f"file://{tmp_path}/a/last.ckpt")
    assert read_checkpoint(str(tmp_path / "a" / "last.ckpt"))["global_step"] == 4
    import fsspec

    url = f"memory://{tmp_path.name}/last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"global_step": 5}, url)
    fs = fsspec.filesystem("memory")
    assert fs.ls(f"/{tmp_path.name}", detail=False) == [f"/{tmp_path.name}/last.ckpt"]
    with fs.open(url) as f:
        assert torch.load(f, weights_only=True)["global_step"] == 5


def test_the_cli_installs_the_atomic_checkpoint_io_unless_the_config_names_one(tmp_path, tiny_demo):
    config = tiny_config(tmp_path, tiny_demo.root, max_steps=2)

    def checkpoint_io(*extra: str):
        cli = MMSSLCLI(model_class=pl.LightningModule, datamodule_class=pl.LightningDataModule,
                       subclass_mode_model=True, subclass_mode_data=True, run=False,
                       args=["--config", config, f"--trainer.default_root_dir={tmp_path}", *extra])
        return cli.trainer.strategy.checkpoint_io

    assert type(checkpoint_io()) is SafeCheckpointIO  # atomic saves, loads through the one reader
    assert type(checkpoint_io("--trainer.plugins=lightning.pytorch.plugins.io.TorchCheckpointIO")) is TorchCheckpointIO


@pytest.mark.parametrize("when", [1, 2, 3])
def test_a_full_disk_at_any_write_names_the_checkpoint(tmp_path, when):
    """Writes from the ``when``-th on fail with ENOSPC: at the second, torch.save's own error
    ("unexpected pos ...") named neither the file nor the cause."""
    _strace()
    target, report = tmp_path / "last.ckpt", tmp_path / "report.txt"
    AtomicCheckpointIO().save_checkpoint({"global_step": 1}, str(target))

    def save() -> None:
        try:
            atomic_torch_save({"global_step": 2, "w": torch.ones(300_000), "v": torch.ones(10)}, str(target))
            said = "saved"
        except Exception as err:
            said = f"{type(err).__name__}: {err}"
        fd = os.open(report, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.pwrite(fd, said.encode(), 0)  # pwrite64: not among the failing writes
        os.close(fd)

    assert _fork_under_strace(["-e", "trace=write", "-e", f"inject=write:error=ENOSPC:when={when}+"], save) == 0
    assert report.read_text().startswith(f"OSError: [Errno 28] could not write checkpoint {target} (No space left")
    assert read_checkpoint(str(target))["global_step"] == 1


def test_mmssl_fit_out_of_room_ends_with_one_line_naming_the_file(monkeypatch, capsys):
    import mmssl.cli

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "could not write checkpoint runs/version_0/checkpoints/last.ckpt "
                                    "(No space left on device); the previous file there, if any, is unchanged")

    monkeypatch.setattr(mmssl.cli, "cli_main", full_disk)
    with pytest.raises(SystemExit) as exit_:
        main(["fit"])
    assert exit_.value.code == 1
    assert capsys.readouterr().err == ("mmssl: could not write checkpoint runs/version_0/checkpoints/last.ckpt (No "
                                       "space left on device); the previous file there, if any, is unchanged\n")
    monkeypatch.setattr(mmssl.cli, "cli_main", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EACCES, "x")))
    with pytest.raises(PermissionError):  # any other OSError keeps its traceback
        main(["fit"])
