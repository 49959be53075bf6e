"""The rank watchdog through the real CLI on 2 gloo processes (mmssl/watchdog.py): a rank that
fails takes the others (and every data-loader worker) down within seconds, its error printed once;
a stalled data-loader worker ends the run with a message naming its rank and every stack on disk."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.cli_runs import PG_TIMEOUT, REPO, cli_env


def _session(sid: int) -> list[str]:
    """``pid name`` of every process left in session ``sid`` (ranks, fork servers, loader workers)."""
    left = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
            if int(fields[3]) == sid and fields[0] != "Z":
                left.append(f"{entry} {name}")
    return left


def run_until_all_gone(args: list[str], cwd: Path, env: dict, timeout: float = 300) -> tuple[int, str, float]:
    """Run ``mmssl ARGS`` in a session of its own until its first process ends; then wait for every
    other process of the session to end by itself.

    Returns:
        The exit status, the output, and the seconds the other processes outlived the first (the
        test fails, listing them, where any is alive 60 s on; they are killed then).
    """
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([sys.executable, "-m", "mmssl", *args], cwd=cwd, env=env, stdout=log,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            log.seek(0)
            raise AssertionError(f"hung for {timeout:.0f} s:\n{log.read()[-3000:]}")
        ended, left = time.monotonic(), _session(proc.pid)
        while left and time.monotonic() - ended < 60:
            time.sleep(0.2)
            left = _session(proc.pid)
        outlived = time.monotonic() - ended
        with_left = list(left)
        for pid in (int(p.split()[0]) for p in left):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.seek(0)
        out = log.read()
    assert not with_left, f"still running 60 s after the first process ended: {with_left}\n{out[-3000:]}"
    return proc.returncode, out, outlived


def _args(tmp_path, demo, clip_json) -> list[str]:
    return [
        "fit", "--config", str(REPO / "configs/demo/clip.yaml"), "--config", str(REPO / "configs/trainer/ddp_cpu.yaml"),
        PG_TIMEOUT, f"--model.init_args.model_name={clip_json}", f"--data.init_args.demo_dir={demo.root}",
        "--data.init_args.batch_size=4", "--data.init_args.num_workers=2", "--trainer.max_steps=6",
        f"--trainer.default_root_dir={tmp_path / 'runs'}", "--trainer.enable_progress_bar=false",
        "--trainer.limit_val_batches=0",
    ]


@pytest.mark.parametrize("failing, stalled", [(0, False), (1, False), (0, True)])
def test_a_failing_rank_takes_every_process_down_within_seconds(failing, stalled, tmp_path, tiny_demo,
                                                                tiny_clip_json):
    """Rank ``failing`` raises at step 2. Under Lightning's launcher, rank 0's failure left rank 1 and
    its workers waiting for ever where rank 1 waited for a stalled worker (``stalled``; Lightning
    #8130), and otherwise rank 1 printed an error of its own (its peer gone): every process now ends
    within seconds, and the error is printed once (the other rank says it ends because of it)."""
    message = f"boom on rank {failing}"
    env = cli_env(MMSSL_TEST_STALL_WORKER="1:1") if stalled else cli_env()
    code, out, outlived = run_until_all_gone([
        *_args(tmp_path, tiny_demo, tiny_clip_json), "--trainer.callbacks+=watchdog_helpers.RaiseAtStep",
        f"--trainer.callbacks.rank={failing}", "--trainer.callbacks.step=2", f"--trainer.callbacks.message={message}",
    ], tmp_path, env)
    assert code != 0
    assert out.count(f"RuntimeError: {message}\n") == 1, out[-3000:]  # the traceback's last line, once
    assert outlived < 20, out[-3000:]
    if failing == 0:  # rank 1 outlives it by a moment and says why it ends
        assert f"mmssl: rank 1 ends: rank 0 failed (RuntimeError: {message}" in out, out[-3000:]


def test_a_stalled_worker_names_its_rank_and_every_process_writes_its_stacks(tmp_path, tiny_demo, tiny_clip_json):
    """Data-loader worker 0 of rank 1 stops after 2 batches. Before, rank 0 ended at the
    process-group timeout (2 min here, 5 min by default) with gloo's "Timed out waiting ... for send"
    from DDP's buffer broadcast, naming neither rank 1 nor its worker; now every rank ends at the
    hang timeout (20 s here) with a message naming rank 1 and its worker, and the run folder holds
    each rank's and the stalled worker's stacks."""
    start = time.monotonic()
    code, out, outlived = run_until_all_gone(_args(tmp_path, tiny_demo, tiny_clip_json), tmp_path, cli_env(
        MMSSL_TEST_STALL_WORKER="1:2", MMSSL_HANG_TIMEOUT_S="20"))
    assert code != 0
    assert "mmssl: hang: rank 1 is late (rank 1: waiting for a batch from data-loader worker 0 for " in out, out[-3000:]
    assert "Timed out waiting" not in out  # not gloo's timeout: the watchdog's, before it
    hang = tmp_path / "runs" / "version_0" / "hang"
    assert "stalled_in_the_worker" in (hang / "rank1-worker0.txt").read_text()
    assert "waiting for a batch from data-loader worker 0" in (hang / "rank1.txt").read_text()
    assert (hang / "rank0.txt").exists()
    assert outlived < 20 and time.monotonic() - start < 110, out[-3000:]  # before the 2-minute process-group timeout
