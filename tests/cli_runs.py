"""Run the real ``mmssl`` command in a subprocess under a hard timeout that also kills its ranks.

Lightning's DDP launcher starts ranks 1..N-1 as children of rank 0; ``subprocess.run(timeout=)``
would kill rank 0 alone and leave a hung child holding the test. Each run gets its own session,
and the whole process group is killed when the time is up, so a hang fails the test, never CI.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parents[1]
# A desynchronised collective must fail fast: the process-group timeout of test runs. Two minutes:
# on 2 loaded cores a rank has once reached the first collective more than one minute after the
# other (start-up, data workers), which a one-minute timeout reported as a hang.
PG_TIMEOUT = "--trainer.strategy.init_args.timeout=0:02:00"


STACKS_AFTER_S = "110"  # below PG_TIMEOUT's 2 minutes


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of a test's CLI run: the repository and tests importable, one OpenMP
    thread, and every rank's stacks printed 110 s in (tests/site/sitecustomize.py: a little
    before PG_TIMEOUT's 2 minutes, so a run failing at a collective shows where the late rank was)."""
    path = os.pathsep.join(str(p) for p in (REPO, REPO / "tests", REPO / "tests" / "site"))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "MMSSL_TEST_STACKS_AFTER_S": STACKS_AFTER_S,
            **extra}


def _print_stacks(folder: str, after_s: str) -> None:
    """Print the stacks the run's processes dumped (tests/site/sitecustomize.py): pytest shows a
    failed test's printed output, and the assertion's own message keeps the run's output tail."""
    for name in sorted(os.listdir(folder)):
        text = Path(folder, name).read_text(errors="replace")
        if text.strip():
            print(f"--- {name}: stacks of a process still running {after_s} s in ---\n{text}")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for MASTER_PORT): fixed ports collide between runs."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_together(commands: list[list[str]], timeout: float, cwd: Optional[Path] = None,
                 envs: Optional[list[dict]] = None) -> list[tuple[int, str]]:
    """Start ``commands`` at once (the ranks or nodes of one run, as a launcher would), each in its
    own session, and wait for all of them, killing every process group after ``timeout`` s.

    Each process writes to a file of its own, never to a pipe: a pipe that this test does not read
    while it waits for another process fills at 64 KiB, and the writer (a rank, or a data-loader
    worker writing a warning) then blocks forever, which reads as that rank hanging.

    Returns:
        (return code, output) per command, stdout and stderr merged.

    Raises:
        AssertionError: a process outlived ``timeout`` (a hang), with each one's output tail.
    """
    envs = envs or [cli_env() for _ in commands]
    with tempfile.TemporaryDirectory() as folder:
        logs = [open(Path(folder) / f"{i}.log", "w+") for i in range(len(commands))]
        procs = [subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                                  start_new_session=True) for command, env, log in zip(commands, envs, logs)]
        deadline, hung = time.monotonic() + timeout, False
        try:
            for proc in procs:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung = True
        finally:
            for proc in procs:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the group: a hang, or a data worker left behind
                except ProcessLookupError:
                    pass
                proc.wait()
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
            log.close()
    if hung:
        tails = "\n".join(f"--- process {i} ---\n{out[-2000:]}" for i, out in enumerate(outputs))
        raise AssertionError(f"{len(commands)} processes started together did not all finish in {timeout:.0f} s "
                             f"(hang?):\n{tails}")
    return [(proc.returncode, out) for proc, out in zip(procs, outputs)]


def run_one_process(args: list[str]) -> subprocess.CompletedProcess:
    """``mmssl ARGS`` on one process, in this interpreter: the single-process reference of a
    2-process test, without a fresh interpreter's ~10 s of imports. Output is not captured."""
    from mmssl.cli import main

    main(args)
    return subprocess.CompletedProcess(["mmssl", *args], 0, "", "")


def run_mmssl(args: list[str], cwd: Path, timeout: float = 300, env: Optional[dict] = None,
              launcher: Optional[list[str]] = None, killed: bool = False) -> subprocess.CompletedProcess:
    """``python -m mmssl ARGS`` (or ``LAUNCHER -m mmssl ARGS``); the process group dies at ``timeout``.

    The run is over when its first process (rank 0, or the launcher) exits; ranks it leaves
    behind are killed then. Output goes through a file: a leftover rank holding a pipe open
    would keep a reader waiting.

    Returns:
        The completed process, stdout and stderr merged into ``stdout``.

    ``killed``: the run SIGKILLs itself (``tests.helpers.KillAtStep``): its return code is then
    ``-SIGKILL``, and only running past ``timeout`` is a hang.

    Raises:
        AssertionError: the run did not end within ``timeout`` seconds (it was killed).
    """
    command = [sys.executable, *(launcher or []), "-m", "mmssl", *args]
    with tempfile.TemporaryFile("w+") as log, tempfile.TemporaryDirectory() as stacks:
        env = {**(env or cli_env()), "MMSSL_TEST_STACKS_DIR": stacks}
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the group: ranks left behind, or a hang
            except ProcessLookupError:
                pass
            proc.wait()
        log.seek(0)
        out = log.read()
        if proc.returncode != 0 and not (killed and proc.returncode == -signal.SIGKILL and not timed_out):
            _print_stacks(stacks, env.get("MMSSL_TEST_STACKS_AFTER_S", "?"))
    if proc.returncode == -signal.SIGKILL and (timed_out or not killed):
        raise AssertionError(f"mmssl {' '.join(args[:3])} ... hung for {timeout:.0f} s; output tail:\n{out[-3000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, out, "")


_SHARED: dict[tuple[str, ...], Path] = {}


def shared_run(tmp_path_factory, args_for: Callable[[Path], list[str]], timeout: float = 300) -> Path:
    """The folder of ``mmssl ARGS``, ARGS = ``args_for(folder)``, run once per session: the reference
    run several tests (in several files) compare against, when its command is the same word for word
    (the folder aside; the session's demo set is in the key). Only a run that exited 0 is kept (a
    failed one fails each test asking for it, and a rerun runs it again). Tests only read the folder.
    """
    key = tuple(args_for(Path("{FOLDER}")))
    if key not in _SHARED:
        folder = tmp_path_factory.mktemp("shared") / "run"
        out = run_mmssl(args_for(folder), folder.parent, timeout=timeout)
        assert out.returncode == 0, out.stdout[-4000:]
        _SHARED[key] = folder
    return _SHARED[key]


def last_metrics(run_dir: Path, prefixes: tuple[str, ...] = ("val/", "probe/")) -> dict[str, float]:
    """The last logged value of every ``metrics.csv`` column starting with one of ``prefixes``."""
    out: dict[str, float] = {}
    with open(run_dir / "metrics.csv", newline="") as f:
        for row in csv.DictReader(f):
            out.update({k: float(v) for k, v in row.items() if v not in ("", None) and k.startswith(prefixes)})
    return out


def run_tool(name: str, args: list[str], monkeypatch) -> int:
    """``python tools/NAME ARGS`` in-process, run as ``__main__`` as a user runs it: its exit status."""
    import runpy

    monkeypatch.setattr(sys, "argv", [name, *args])
    try:
        runpy.run_path(str(REPO / "tools" / name), run_name="__main__")
    except SystemExit as exit_:
        return int(exit_.code or 0)
    return 0


# SGD: AdamW would turn a zero gradient's float noise (a key bias's) into full-size steps in random
# directions, hiding what a two-ranks-against-one-process test compares.
SGD = '{"class_path": "torch.optim.SGD", "init_args": {"lr": 0.5, "momentum": 0.9}}'


def lockstep_runs(folder: Path, config: str, args_for, fsdp2: bool = False) -> dict[Any, tuple[dict, Path]]:
    """``mmssl fit --config CONFIG`` on 2 gloo ranks (batch 4 each) and on one process (batch 8)
    over an 8-sample demo set: every epoch is ONE global batch of the same 8 samples in both runs
    (mmssl.data.plan deals contiguous runs and shuffles within a rank), so both take the same
    optimizer steps; SGD, warm-up 1, no loader workers, ``tests.helpers.DumpParams``.

    Args:
        folder: the test's tmp_path (the demo set and each run's folder go under it).
        config: the recipe, before ``configs/trainer/ddp_cpu.yaml`` on 2 ranks.
        args_for: processes -> that run's own flags (model, trainer length, validation, ...).
        fsdp2: also on 2 ranks under FSDP2 (``configs/trainer/fsdp2_cpu.yaml``), key ``"fsdp2"``.

    Returns:
        processes (or ``"fsdp2"``) -> (rank 0's parameters at the end, its run folder
        ``runs/version_0``); the ranks of a 2-process run are checked equal.
    """
    import torch

    from mmssl.data.demo import ensure_demo_data

    demo = ensure_demo_data(str(folder / "demo"), num_train=8, num_val=16, shard_size=8, image_size=32)
    runs = {}
    for run in ((2, "fsdp2", 1) if fsdp2 else (2, 1)):
        processes = 1 if run == 1 else 2
        here = folder / f"p{run}"
        here.mkdir()
        trainer = {2: "ddp_cpu", "fsdp2": "fsdp2_cpu"}.get(run)
        ddp = ["--config", str(REPO / f"configs/trainer/{trainer}.yaml"), PG_TIMEOUT] if trainer else []
        args = [
            "fit", "--config", config, *ddp, *args_for(processes),
            "--model.init_args.warmup_steps=1", f"--model.init_args.optimizer={SGD}",
            f"--data.init_args.demo_dir={demo.root}", f"--data.init_args.batch_size={8 // processes}",
            "--data.init_args.num_workers=0",
            f"--trainer.default_root_dir={here / 'runs'}", "--trainer.enable_progress_bar=false",
            "--trainer.callbacks+=tests.helpers.DumpParams", f"--trainer.callbacks.folder={here / 'params'}",
        ]
        if processes == 2:
            out = run_mmssl(args, here, timeout=300)
            assert out.returncode == 0, out.stdout[-3000:]
            assert "world_size=2" in out.stdout and "global_batch_size=8" in out.stdout
        else:
            run_one_process(args)
        params = [torch.load(here / "params" / f"rank{r}.pt") for r in range(processes)]
        for name in params[0]:
            torch.testing.assert_close(params[-1][name], params[0][name], rtol=0, atol=0, msg=name)
        runs[run] = (params[0], here / "runs" / "version_0")
    return runs
