"""open_clip_train as the peer: the command that runs it on our shards, and what its log says.

Run as ``python -m benchmarks.open_clip_peer [--model-config FILE.json] -- OPEN_CLIP_ARGS``: a small
launcher that works around what stops open_clip_train 3.3.0 on our set-up without editing the
installed package:

- webdataset 1.0.x ends each tar with an ``eof_value`` marker sample (``{}`` by default) that
  open_clip's own ``group_by_keys_nothrow`` reads as a file and fails on with ``KeyError: 'fname'``
  (open_clip issue 935). The launcher swaps ``open_clip_train.data.tarfile_to_samples_nothrow``
  for the same three steps with ``eof_value=None``, which tells webdataset to emit no marker.
- open_clip_train has no flag for a model-config folder; the launcher registers the JSON file with
  ``open_clip.add_model_config`` before calling ``main``.
- It writes a full checkpoint (weights and optimizer state: 1.8 GB at ViT-B-32) when its one epoch
  ends, even with ``--save-frequency 0``; with ``--no-checkpoint`` the launcher makes ``torch.save``
  a no-op in its own process. The write comes after the timed steps: only wall time is saved.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from typing import Callable, Optional

# Lightning precision -> open_clip_train ``--precision`` (open_clip_train/params.py choices).
PRECISIONS: dict[str, str] = {
    "32-true": "fp32", "32": "fp32",
    "bf16-mixed": "amp_bf16", "16-mixed": "amp",
    "bf16-true": "pure_bf16", "16-true": "pure_fp16",
}

# One line per logged step of open_clip_train/train.py ``train_one_epoch``:
#   "Train Epoch: 0 [ 64/640 (10%)] Data (t): 0.012 Batch (t): 0.310, 206.4/s, 206.4/s/gpu LR: ..."
_STEP_LINE = re.compile(r"Train Epoch: \d+ \[\s*(\d+)/\d+.*?Data \(t\): ([\d.]+) Batch \(t\): ([\d.]+),")


def open_clip_precision(precision: str) -> str:
    """open_clip_train's name for a Lightning precision string.

    Raises:
        ValueError: for a precision open_clip_train has no counterpart of.
    """
    if precision not in PRECISIONS:
        raise ValueError(
            f"--precision {precision!r} has no open_clip_train counterpart; use one of {sorted(PRECISIONS)}"
        )
    return PRECISIONS[precision]


def peer_args(
    model: str,
    shards: list[str],
    num_samples: int,
    batch_size: int,
    workers: int,
    precision: str,
    logs: str,
    patch_dropout: Optional[float] = None,
) -> list[str]:
    """open_clip_train arguments for the same run as ours.

    Args:
        model: open_clip model name (registered by the launcher if it came from a JSON file).
        shards: shard URLs (joined with ``::``, which open_clip_train expands as we do).
        num_samples: samples in the one epoch it runs (steps x batch size).
        batch_size: per-device batch size.
        workers: loader workers.
        precision: Lightning precision string, translated.
        logs: a fresh folder for its logs and the checkpoint it writes at the end regardless.
        patch_dropout: ``--force-patch-dropout`` (FLIP-style token dropping in its image tower).

    Returns:
        The argument list for ``open_clip_train.main``.
    """
    args = [
        "--train-data", "::".join(shards), "--dataset-type", "webdataset",
        # Resampled shards, as mmssl's training stream; also lifts its shards >= workers check.
        "--dataset-resampled", "--train-num-samples", str(num_samples),
        "--model", model, "--batch-size", str(batch_size), "--workers", str(workers),
        "--precision", open_clip_precision(precision), "--epochs", "1",
        "--save-frequency", "0", "--zeroshot-frequency", "0", "--val-frequency", "0",
        "--log-every-n-steps", "1", "--logs", logs, "--name", "bench", "--seed", "0",
    ]
    if patch_dropout:
        args += ["--force-patch-dropout", str(patch_dropout)]
    return args


def parse_peer_log(text: str, warmup: int) -> dict[str, float]:
    """samples/s, step time and data-wait fraction from open_clip_train's per-step log lines.

    With ``--log-every-n-steps 1`` its meters are reset after every line, so each line's
    ``Batch (t)`` is one step's wall time (data, forward, backward, optimizer) and ``Data (t)``
    that step's wait for data, the same spans ``benchmarks/meter.py``'s ``StepTimer`` measures.

    Args:
        text: its stdout/stderr.
        warmup: leading steps to drop.

    Returns:
        ``samples_per_s``, ``step_time_s`` (median), ``data_wait_fraction``, ``steps``.

    Raises:
        RuntimeError: if fewer than ``warmup + 1`` step lines are found.
    """
    rows = [(int(m[1]), float(m[2]), float(m[3])) for m in _STEP_LINE.finditer(text)]
    if len(rows) <= warmup:
        tail = "\n".join(text.splitlines()[-15:])
        raise RuntimeError(
            f"open_clip_train logged {len(rows)} steps, need more than {warmup}; its output ended:\n{tail}"
        )
    seen = [rows[0][0]] + [b[0] - a[0] for a, b in zip(rows, rows[1:])]  # samples per step
    timed = list(zip(seen, rows))[warmup:]
    total = sum(r[2] for _, r in timed)
    return {
        "samples_per_s": sum(n for n, _ in timed) / total,
        "step_time_s": statistics.median(r[2] for _, r in timed),
        "data_wait_fraction": sum(r[1] for _, r in timed) / total,
        "steps": len(timed),
    }


def eof_free_tar_expander(data_module) -> Callable:
    from webdataset.tariterators import tar_file_expander, url_opener

    def tarfile_to_samples_nothrow(src, handler=data_module.log_and_continue):
        # open_clip_train/data.py's function, but without webdataset 1.0's end-of-shard marker.
        streams = url_opener(src, handler=handler)
        files = tar_file_expander(streams, handler=handler, eof_value=None)
        return data_module.group_by_keys_nothrow(files, handler=handler)

    return tarfile_to_samples_nothrow


def launch(argv: Optional[list[str]] = None) -> None:
    """Patch open_clip_train as described in the module docstring, then run its ``main``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-config", help="JSON open_clip model config to register first")
    parser.add_argument("--no-checkpoint", action="store_true", help="skip the checkpoint it writes at the end")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="-- then open_clip_train arguments")
    args = parser.parse_args(argv)
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest

    import open_clip
    import open_clip_train.data as data
    from open_clip_train.main import main

    if args.model_config:
        open_clip.add_model_config(args.model_config)
    data.tarfile_to_samples_nothrow = eof_free_tar_expander(data)
    if args.no_checkpoint:
        import torch

        torch.save = _no_save
    main(rest)


def _no_save(*args, **kwargs) -> None:
    """``torch.save`` in the launcher's process with ``--no-checkpoint``: writes nothing."""


if __name__ == "__main__":
    launch(sys.argv[1:])
