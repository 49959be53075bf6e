"""The MFU denominator: a matmul peak probed around the timed steps, best of several long repeats,
and no MFU figure where the model outran it (a ratio above 100% is never printed)."""

import time
from types import SimpleNamespace

import torch

from benchmarks.bench import format_report, summarise
from benchmarks.meter import PeakProbe, StepTimer, model_flop_utilisation

CPU = torch.device("cpu")


def test_probe_repeats_are_long_enough_and_the_best_counts():
    probe = PeakProbe(CPU, "32-true", size=64, repeats=3, min_time_s=0.02)
    first, second = probe.measure(), probe.measure()
    assert probe.matmuls_per_repeat > 1  # one 64-wide matmul takes far less than 20 ms
    assert probe.measurements == [first, second] and probe.best == max(first, second) > 0


def test_repeat_length_is_calibrated_by_doubling():
    class Clocked(PeakProbe):  # each matmul "takes" 3 ms, every call: deterministic
        def _timed(self, a, b, out, n):
            return 0.003 * n

    probe = Clocked(CPU, "32-true", size=8, repeats=2, min_time_s=0.02)
    assert probe.measure() == 2 * 8**3 * 8 / 0.024  # 8 matmuls: the first count lasting >= 20 ms
    assert probe.matmuls_per_repeat == 8


def test_mfu_is_never_above_one():
    assert model_flop_utilisation(10**9, 10, 1.0, 2e10) == 0.5
    assert model_flop_utilisation(10**9, 10, 1.0, 1e10) == 1.0
    assert model_flop_utilisation(10**9, 10, 1.0, 5e9) is None  # the model outran the probe
    assert model_flop_utilisation(10**9, 10, 0.0, 5e9) is None


class _SleepyProbe:
    """A probe whose measurement takes 0.2 s: it must fall outside every timed step."""

    def __init__(self):
        self.measurements, self.best = [], 0.0

    def measure(self):
        time.sleep(0.2)
        self.measurements.append(1e9)
        self.best = 1e9
        return 1e9


def test_probe_runs_before_and_after_the_timed_steps_outside_them():
    probe = _SleepyProbe()
    timer = StepTimer(warmup=1, device=CPU, probe=probe)
    trainer, module = SimpleNamespace(global_step=0, accumulate_grad_batches=1), SimpleNamespace()
    batch = {"image": torch.zeros(4, 3, 8, 8)}
    timer.on_train_start(trainer, module)
    for step in range(4):  # 1 warm-up + 3 timed
        timer.on_train_batch_start(trainer, module, batch, step)
        torch.randn(32, 32) @ torch.randn(32, 32)
        trainer.global_step = step + 1
        timer.on_train_batch_end(trainer, module, None, batch, step)
        if step == 0:
            assert len(probe.measurements) == 1  # right after the warm-up step
    timer.on_train_end(trainer, module)
    assert module.flops_per_batch == 2 * 32**3  # the counted warm-up step, for ThroughputMonitor
    assert len(probe.measurements) == 2 and len(timer.times.step) == 3
    assert sum(timer.times.step) < 0.2  # neither 0.2 s probe is inside a timed step

    # A model figure above the probe's best is not printed as a utilisation above 100%.
    timer.flops_per_step = 10**12
    result = summarise(timer, CPU, "32-true")
    assert result["mfu"] is None and result["matmul_peak_flops"] == 1e9
    run = {**result, "precision": "32-true", "batch_size": 4, "num_workers": 0}
    report = format_report({"mmssl": run})
    assert "peak probe is unreliable" in report and "%" not in report.split("model FLOP utilisation")[1]
    timer.flops_per_step = 10**5
    assert "model FLOP utilisation: " in format_report({"mmssl": {**run, **summarise(timer, CPU, "32-true")}})
