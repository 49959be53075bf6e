"""What one benchmark run measures: step times, data wait, FLOPs per step, peak memory, peak FLOP/s.

FLOPs are counted with the package's own counter (:func:`mmssl.flops.count_flops`, what the run
summary records); the matmul peak (the MFU denominator) is measured by a :class:`PeakProbe` right
before and right after the timed steps, and its best repeat counts.

Timing rides on Lightning's own loop (a Callback), so the figure is what ``mmssl fit`` delivers,
logging and optimizer included, as open_clip_train's own ``Batch (t)`` includes its whole loop.
"""

from __future__ import annotations

import contextlib
import resource
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch.utils.flop_counter import FlopCounterMode

from mmssl.flops import count_flops

try:  # psutil reads the current RSS; without it only the kernel's lifetime peak is known
    import psutil
except ImportError:  # pragma: no cover - depends on the environment
    psutil = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    With a ``probe``, the matmul peak is measured right after the last warm-up step (the device as
    warm as in the timed steps) and when training ends, outside every timed span.

    Args:
        warmup: steps run before timing starts (at least 1: the FLOP-counted step).
        device: where the model runs; CUDA work is synchronised before each clock read.
        probe: measures the device's matmul peak around the timed steps.
    """

    def __init__(self, warmup: int, device: torch.device, probe: Optional["PeakProbe"] = None) -> None:
        if warmup < 1:
            raise ValueError(f"--warmup must be >= 1 (one warm-up step counts FLOPs), got {warmup}")
        self.warmup, self.device, self.probe = warmup, device, probe
        self.times = StepTimes()
        self.flops_per_step: Optional[int] = None
        self.peak_rss = 0
        self._last_end: Optional[float] = None
        self._start: Optional[float] = None
        self._counting: Optional[contextlib.ExitStack] = None
        self._counter: Optional[FlopCounterMode] = None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._start = time.perf_counter()
        if trainer.global_step == self.warmup - 1:
            self._counting = contextlib.ExitStack()
            self._counter = self._counting.enter_context(count_flops())
        if trainer.global_step == self.warmup and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._counting is not None:  # closed before the clock read: not part of a timed step
            self._counting.close()
            self.flops_per_step = self._counter.get_total_flops()
            self._counting = None
            # The figure ThroughputMonitor asks for (a config's Throughput callback), per micro-batch.
            pl_module.flops_per_batch = self.flops_per_step // trainer.accumulate_grad_batches
        _sync(self.device)
        end = time.perf_counter()
        # global_step already counts this step's optimizer update.
        if trainer.global_step > self.warmup and self._last_end is not None:
            self.times.step.append(end - self._last_end)
            self.times.data_wait.append(self._start - self._last_end)
            self.times.batch_size.append(_batch_size(batch))
            self.peak_rss = max(self.peak_rss, current_rss())
        if trainer.global_step == self.warmup and self.probe is not None:
            self.probe.measure()  # before the first timed span opens
            end = time.perf_counter()
        self._last_end = end

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not hasattr(pl_module, "flops_per_batch"):
            pl_module.flops_per_batch = None  # known after step warmup - 1; ThroughputMonitor waits

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.probe is not None:
            self.probe.measure()  # after the last timed span closed


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


class PeakProbe:
    """The device's matmul peak FLOP/s at a precision: the MFU denominator, measured.

    A measured peak rather than a datasheet figure: on a shared CPU the datasheet is unreachable,
    and the ratio then says how well the model uses what the device delivers now. One short
    matmul is not a peak (launch latency, clocks still ramping, a neighbour's burst on a shared
    CPU), so each measurement runs ``repeats`` timed repeats of back-to-back square matmuls, each
    repeat at least ``min_time_s`` long (matmuls per repeat doubled until one lasts that long, once),
    and :attr:`best` keeps the fastest repeat over every call. The benchmark measures it right
    before and right after the timed steps, so a device slowed or sped up during the run is seen.

    Args:
        device: where to measure.
        precision: a Lightning precision string (``32-true``, ``bf16-mixed``, ``16-mixed``...).
        size: matrix side; default 1024 on CPU (bf16/fp16: 512, emulated ~40x slower on CPUs
            without AMX), 8192 on GPU.
        repeats: timed repeats per :meth:`measure`, after one untimed warm-up matmul; default 3
            on CPU, 5 on GPU.
        min_time_s: shortest repeat; default 0.1 s on CPU (several 1024-wide matmuls), 0.05 s
            on GPU (tens of 8192-wide ones).
    """

    def __init__(self, device: torch.device, precision: str, size: Optional[int] = None,
                 repeats: Optional[int] = None, min_time_s: Optional[float] = None) -> None:
        gpu = device.type == "cuda"
        repeats = repeats if repeats is not None else (5 if gpu else 3)
        if repeats < 1:
            raise ValueError(f"PeakProbe: repeats must be >= 1, got {repeats}")
        self.device, self.repeats = device, repeats
        self.dtype = autocast_dtype(precision) or torch.float32
        half = self.dtype in (torch.bfloat16, torch.float16)
        self.size = size or (8192 if gpu else (512 if half else 1024))
        self.min_time_s = min_time_s if min_time_s is not None else (0.05 if gpu else 0.1)
        self.best = 0.0  # FLOP/s of the fastest repeat so far
        self.matmuls_per_repeat: Optional[int] = None
        self.measurements: list[float] = []  # best FLOP/s of each measure() call

    def _timed(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, n: int) -> float:
        _sync(self.device)
        t0 = time.perf_counter()
        for _ in range(n):
            torch.matmul(a, b, out=out)
        _sync(self.device)
        return time.perf_counter() - t0

    def measure(self) -> float:
        """Run one measurement; returns its best FLOP/s (also folded into :attr:`best`)."""
        n = self.size
        a = torch.randn(n, n, device=self.device, dtype=self.dtype)
        b = torch.randn(n, n, device=self.device, dtype=self.dtype)
        out = torch.empty(n, n, device=self.device, dtype=self.dtype)
        self._timed(a, b, out, 1)  # warm-up: kernel selection, clocks
        if self.matmuls_per_repeat is None:  # double until one repeat lasts min_time_s
            count = 1
            while self._timed(a, b, out, count) < self.min_time_s:
                count *= 2
            self.matmuls_per_repeat = count
        flop = 2 * n**3 * self.matmuls_per_repeat
        fastest = max(flop / self._timed(a, b, out, self.matmuls_per_repeat) for _ in range(self.repeats))
        self.measurements.append(fastest)
        self.best = max(self.best, fastest)
        return fastest


def matmul_peak_flops(device: torch.device, precision: str, size: Optional[int] = None,
                      repeats: Optional[int] = None, min_time_s: Optional[float] = None) -> float:
    """One :class:`PeakProbe` measurement: the best FLOP/s of ``repeats`` timed repeats.

    Args:
        device: where to measure.
        precision: a Lightning precision string.
        size: matrix side (the probe's default when ``None``).
        repeats: timed repeats (the probe's default when ``None``).
        min_time_s: shortest repeat (the probe's default when ``None``).

    Returns:
        FLOP/s (2 * n^3 per matmul).
    """
    return PeakProbe(device, precision, size, repeats, min_time_s).measure()


def model_flop_utilisation(flops_per_step: int, steps: int, seconds: float, peak: float) -> Optional[float]:
    """Model FLOP/s over the measured matmul peak; ``None`` where that ratio would exceed 1.

    A model cannot run its matmuls faster than the best square matmul the probe timed around it;
    a ratio above 1 means the probe missed the device's peak (a shared device whose load changed,
    clocks that moved) or the counted step was heavier than the timed ones, so no figure is given.

    Args:
        flops_per_step: FLOPs of one counted training step.
        steps: timed steps.
        seconds: their total wall time.
        peak: the probe's best FLOP/s.
    """
    if peak <= 0 or seconds <= 0:
        return None
    mfu = flops_per_step * steps / seconds / peak
    return mfu if mfu <= 1.0 else None
