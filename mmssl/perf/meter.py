"""What one benchmark run measures: step times, data wait, FLOPs per step, peak memory, peak FLOP/s.

Timing rides on Lightning's own loop (a Callback), so the figure is what ``mmssl fit`` delivers,
logging and optimizer included, as open_clip_train's own ``Batch (t)`` includes its whole loop.
"""

from __future__ import annotations

import contextlib
import resource
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import lightning.pytorch as pl
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

try:  # psutil reads the current RSS; without it only the kernel's lifetime peak is known
    import psutil
except ImportError:  # pragma: no cover - depends on the environment
    psutil = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def count_flops() -> Iterator[FlopCounterMode]:
    """Count the FLOPs of the code inside: the project's one FLOP counter.

    torch's ``FlopCounterMode`` with the math attention backend: FlopCounterMode has no formula
    for the CPU flash-attention op, and the math backend decomposes attention into the matmuls
    it does count. Only the counted code runs with the math backend.

    Yields:
        The counter; ``counter.get_total_flops()`` once the block has ended.
    """
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        yield counter


@dataclass
class StepTimes:
    """Per-step wall times of the timed steps (seconds) and the images in each batch."""

    step: list[float] = field(default_factory=list)
    data_wait: list[float] = field(default_factory=list)
    batch_size: list[int] = field(default_factory=list)


class StepTimer(pl.Callback):
    """Times every training step after ``warmup`` steps and counts the FLOPs of one step.

    A step spans from the end of the previous batch to the end of this one: fetching the batch,
    forward, backward, optimizer and logging. The data wait is the part from the previous batch's
    end to this batch's start (Lightning fetches one batch per step there). Step ``warmup - 1`` (the
    last warm-up step, so kernels and allocators are warm) runs under :func:`count_flops`.

    Args:
        warmup: steps run before timing starts (at least 1: the FLOP-counted step).
        device: where the model runs; CUDA work is synchronised before each clock read.
    """

    def __init__(self, warmup: int, device: torch.device) -> None:
        if warmup < 1:
            raise ValueError(f"--warmup must be >= 1 (one warm-up step counts FLOPs), got {warmup}")
        self.warmup, self.device = warmup, device
        self.times = StepTimes()
        self.flops_per_step: Optional[int] = None
        self.peak_rss = 0
        self._last_end: Optional[float] = None
        self._start: Optional[float] = None
        self._counting: Optional[contextlib.ExitStack] = None
        self._counter: Optional[FlopCounterMode] = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()
        if trainer.global_step == self.warmup - 1:
            self._counting = contextlib.ExitStack()
            self._counter = self._counting.enter_context(count_flops())
        if trainer.global_step == self.warmup and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._counting is not None:  # closed before the clock read: not part of a timed step
            self._counting.close()
            self.flops_per_step = self._counter.get_total_flops()
            self._counting = None
        _sync(self.device)
        end = time.perf_counter()
        # global_step already counts this step's optimizer update.
        if trainer.global_step > self.warmup and self._last_end is not None:
            self.times.step.append(end - self._last_end)
            self.times.data_wait.append(self._start - self._last_end)
            self.times.batch_size.append(_batch_size(batch))
            self.peak_rss = max(self.peak_rss, current_rss())
        self._last_end = end


def _batch_size(batch: Any) -> int:
    if isinstance(batch, dict):
        return len(batch["image"])
    return len(batch[0])


def current_rss() -> int:
    """Resident memory of this process now, in bytes (0 without psutil)."""
    return psutil.Process().memory_info().rss if psutil is not None else 0


def peak_memory(device: torch.device, sampled_rss: int = 0) -> tuple[str, int]:
    """The peak memory figure that matters on ``device``.

    Args:
        device: the model's device.
        sampled_rss: largest RSS seen during the timed steps (psutil), in bytes.

    Returns:
        ``(kind, bytes)``: ``torch.cuda.max_memory_allocated`` since the timed steps began on
        CUDA; else the process's peak RSS (``ru_maxrss``, KiB on Linux, over the whole process
        life, so it also holds set-up peaks) or the sampled RSS when larger.
    """
    if device.type == "cuda":
        return "cuda_max_allocated", int(torch.cuda.max_memory_allocated(device))
    return "process_peak_rss", max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, sampled_rss)


def autocast_dtype(precision: str) -> Optional[torch.dtype]:
    """The matmul dtype a Lightning precision string runs at (``None``: plain fp32)."""
    if precision.startswith("bf16"):
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    if precision.startswith("64"):
        return torch.float64
    return None


def matmul_peak_flops(device: torch.device, precision: str, size: Optional[int] = None, reps: int = 3) -> float:
    """Measured FLOP/s of a square matmul on ``device`` at ``precision``: the MFU denominator.

    A measured peak rather than a datasheet figure, as the issue asks: on a shared CPU the
    datasheet is unreachable anyway, and the ratio then says how well the model uses what the
    device actually delivers now.

    Args:
        device: where to measure.
        precision: a Lightning precision string (``32-true``, ``bf16-mixed``, ``16-mixed``...).
        size: matrix side; 1024 on CPU (bf16: 512, it can be ~40x slower there), 8192 on GPU.
        reps: timed repetitions after one warm-up; the fastest counts.

    Returns:
        FLOP/s (2 * n^3 per matmul).
    """
    dtype = autocast_dtype(precision) or torch.float32
    if size is None:
        size = 8192 if device.type == "cuda" else (512 if dtype in (torch.bfloat16, torch.float16) else 1024)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best = float("inf")
    for i in range(reps + 1):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        if i:
            best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best
