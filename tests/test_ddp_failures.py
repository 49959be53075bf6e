"""A rank that stops joining collectives ends the job with an error, and SIGTERM ends a stuck job."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

from tests.cli_runs import REPO, cli_env, run_mmssl


def _args(tmp_path, demo, clip_json: str, timeout: str) -> list[str]:
    return [
        "fit", "--config", str(REPO / "configs/demo/clip.yaml"),
        "--config", str(REPO / "configs/trainer/ddp_cpu.yaml"), f"--trainer.strategy.init_args.timeout={timeout}",
        f"--model.init_args.model_name={clip_json}", f"--data.init_args.demo_dir={demo.root}",
        "--data.init_args.batch_size=4", "--data.init_args.num_workers=0", "--trainer.max_steps=6",
        f"--trainer.default_root_dir={tmp_path / 'runs'}", "--trainer.enable_progress_bar=false",
        "--trainer.callbacks+=helpers.StallRank", "--trainer.callbacks.rank=1", "--trainer.callbacks.step=2",
        "--trainer.callbacks.seconds=600", f"--trainer.callbacks.marker={tmp_path / 'stalled'}",
    ]


def test_a_desynchronised_collective_fails_naming_the_late_rank(tmp_path, tiny_demo, tiny_clip_json):
    """Rank 1 stops between steps; rank 0 waits in the next step's collectives. The rank watchdog
    (mmssl/watchdog.py) ends the run at 90% of the 30 s process-group timeout, naming rank 1."""
    start = time.monotonic()
    out = run_mmssl(_args(tmp_path, tiny_demo, tiny_clip_json, "0:00:30"), tmp_path, timeout=240)
    elapsed = time.monotonic() - start
    assert out.returncode != 0
    assert "mmssl: hang: rank 1 is late (rank 1: " in out.stdout, out.stdout[-3000:]
    assert "rank 0: in a collective (torch.distributed." in out.stdout  # where the peer waits
    assert (tmp_path / "runs" / "version_0" / "hang" / "rank1.txt").exists()
    assert (tmp_path / "stalled").exists() and elapsed < 180  # the 27 s hang timeout, not the 600 s stall


def test_sigterm_ends_a_run_stuck_in_a_collective(tmp_path, tiny_demo, tiny_clip_json):
    """Rank 0 waits in a collective (process-group timeout 5 min) when SIGTERM arrives."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mmssl", *_args(tmp_path, tiny_demo, tiny_clip_json, "0:05:00")], cwd=tmp_path,
        env=cli_env(MMSSL_SIGTERM_GRACE_S="5"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "stalled").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert (tmp_path / "stalled").exists() and proc.poll() is None
        time.sleep(3)  # rank 0 is now blocked in the next step's gather
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        assert code != 0 and time.monotonic() - sent < 60
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_a_bad_evaluation_set_stops_every_rank_at_start(tmp_path, tiny_demo, tiny_clip_json):
    """A labelled set without classnames.txt: both ranks fail in setup, naming the key, none waits."""
    unnamed = tmp_path / "unnamed"
    unnamed.mkdir()
    shutil.copy(os.path.join(os.path.dirname(tiny_demo.val), "0.tar"), unnamed / "0.tar")
    out = run_mmssl([
        "fit", "--config", str(REPO / "configs/demo/clip.yaml"), "--config", str(REPO / "configs/trainer/ddp_cpu.yaml"),
        "--trainer.strategy.init_args.timeout=0:00:30", f"--model.init_args.model_name={tiny_clip_json}",
        f"--data.init_args.demo_dir={tiny_demo.root}", "--data.init_args.batch_size=4",
        "--data.init_args.num_workers=0", f"--trainer.default_root_dir={tmp_path / 'runs'}",
        "--trainer.callbacks+=mmssl.callbacks.ZeroShot", f"--trainer.callbacks.data={unnamed}",
    ], tmp_path, timeout=180)
    assert out.returncode != 0
    message = f"ZeroShot: init_args.data={str(unnamed)!r}: labelled set {str(unnamed)!r} has no classnames.txt"
    assert out.stdout.count(message) >= 1, out.stdout[-3000:]  # raised in setup (the first rank's, in full)
    assert "Sanity Checking" not in out.stdout
