"""Per-step overhead of the training loop on the tiny CLIP: plain torch, plain Lightning, ``mmssl fit``.

    python benchmarks/step_overhead.py [--batch-size 8] [--steps 150] [--profile 25]

The same model (``configs/fashion_mnist/clip_tiny_28.json``, 8.3M parameters), the same batches
(made once, in memory: no loader in any of the three), fused AdamW, fp32, one thread:

- ``torch``: forward, open_clip's ``ClipLoss``, backward, step, zero_grad: nothing else;
- ``lightning``: a minimal LightningModule doing that step in ``Trainer.fit`` with no callbacks,
  no logger, no checkpointing, no progress bar (Lightning's own loop cost);
- ``mmssl``: the config's ``mmssl fit`` (CLI-built trainer with its callbacks, loggers and
  LR schedule, mmssl's CLIP module with its hooks), fed the same batches.

Prints the median ms/step of each and the differences, and how many times ``NonFiniteGuard`` read
its device flags on the host in the ``mmssl`` run (each read is a device sync on a GPU).
``--runs guard`` times the guard's hook alone on the model's gradients, on both of its paths.
With ``--profile N`` the ``mmssl`` run is profiled (cProfile, N timed steps) and the functions
of mmssl and Lightning callbacks/loggers that cost most per step are listed.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import open_clip
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks.bench (run as a script, only benchmarks/ is on the path)
CONFIG = REPO / "configs/fashion_mnist/clip_tiny.yaml"
MODEL = REPO / "configs/fashion_mnist/clip_tiny_28.json"


def batches(n: int, batch_size: int) -> list[dict[str, torch.Tensor]]:
    """``n`` normalised 28x28 image batches with captions filling the 24-token context (no padding,
    so mmssl's text trimming does not change the compute: the three runs do the same work)."""
    g = torch.Generator().manual_seed(0)
    return [{"image": torch.randn(batch_size, 3, 28, 28, generator=g),
             "text": torch.randint(1, 49407, (batch_size, 24), generator=g)} for _ in range(n)]


def _clip() -> torch.nn.Module:
    open_clip.add_model_config(str(MODEL))
    model = open_clip.create_model(MODEL.stem)
    model.output_dict = True
    return model


def plain_torch(data: list[dict[str, torch.Tensor]], warmup: int) -> list[float]:
    model = _clip().train()
    loss_fn = open_clip.ClipLoss()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    times, last = [], time.perf_counter()
    for i, batch in enumerate(data):
        out = model(batch["image"], batch["text"])
        loss = loss_fn(out["image_features"], out["text_features"], out["logit_scale"])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        now = time.perf_counter()
        if i >= warmup:
            times.append(now - last)
        last = now
    return times


class _Timer(pl.Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup, self.times, self.last = warmup, [], None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        if batch_idx >= self.warmup and self.last is not None:
            self.times.append(now - self.last)
        self.last = now


class _Plain(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model, self.loss_fn = _clip(), open_clip.ClipLoss()

    def training_step(self, batch, batch_idx):
        out = self.model(batch["image"], batch["text"])
        return self.loss_fn(out["image_features"], out["text_features"], out["logit_scale"])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.1, fused=True)


def _loader(data: list[dict[str, torch.Tensor]]) -> DataLoader:
    return DataLoader(data, batch_size=None, shuffle=False, num_workers=0)


def plain_lightning(data: list[dict[str, torch.Tensor]], warmup: int) -> list[float]:
    timer = _Timer(warmup)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=len(data), logger=False, callbacks=[timer],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, default_root_dir=tempfile.mkdtemp(prefix="mmssl_overhead_"))
    trainer.fit(_Plain(), train_dataloaders=_loader(data))
    return timer.times


def mmssl_fit(data: list[dict[str, torch.Tensor]], warmup: int, profile: int = 0) -> tuple[list[float], Optional[str]]:
    from benchmarks.bench import make_cli

    root = tempfile.mkdtemp(prefix="mmssl_overhead_")
    cli = make_cli(str(CONFIG), [f"--model.init_args.model_name={MODEL}", "--trainer.callbacks=[]",
                                 "--trainer.limit_val_batches=0"], len(data), root)
    cli.trainer.callbacks[:] = [c for c in cli.trainer.callbacks if not isinstance(c, ModelCheckpoint)]
    timer = _Timer(warmup)
    cli.trainer.callbacks.append(timer)
    report = None
    if profile:
        profiler = cProfile.Profile()

        class _Profile(pl.Callback):  # profile steps warmup .. warmup + profile
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
                if batch_idx == warmup:
                    profiler.enable()
                if batch_idx == warmup + profile:
                    profiler.disable()

        cli.trainer.callbacks.append(_Profile())
    cli.trainer.fit(cli.model, train_dataloaders=_loader(data))
    guard = next((c for c in cli.trainer.callbacks if type(c).__name__ == "NonFiniteGuard"), None)
    if guard is not None and hasattr(guard, "host_reads"):  # each read is a device sync on a GPU
        print(f"NonFiniteGuard: {guard.host_reads} host reads of its flags in {len(data)} steps")
    if profile:
        report = _top(profiler, profile)
    return timer.times, report


def guard_hook(reps: int = 200) -> dict[str, float]:
    """Median ms of ``NonFiniteGuard.on_before_optimizer_step`` alone on the tiny CLIP's gradients:
    the sync-free path (fused AdamW) and the synchronous one (foreach AdamW), interleaved."""
    from types import SimpleNamespace

    from mmssl.callbacks.guards import NonFiniteGuard

    model = _clip()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    trainer = SimpleNamespace(world_size=1, global_step=0, precision_plugin=None)  # what the hook reads
    module = SimpleNamespace(device=torch.device("cpu"))
    cases = {"guard sync-free (fused AdamW)": (NonFiniteGuard(every_n_steps=10**9),
                                                torch.optim.AdamW(model.parameters(), fused=True)),
             "guard synchronous (foreach AdamW)": (NonFiniteGuard(), torch.optim.AdamW(model.parameters()))}
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(reps):
        for name, (guard, optimizer) in cases.items():
            start = time.perf_counter()
            guard.on_before_optimizer_step(trainer, module, optimizer)
            times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def _top(profiler: cProfile.Profile, steps: int, n: int = 25) -> str:
    """The costliest functions per step by cumulative time, outside torch's own kernels."""
    stats = pstats.Stats(profiler)
    rows = []
    for (file, line, name), (_, calls, tottime, cumtime, _) in stats.stats.items():
        if (
            "/mmssl/" in file
            or "/callbacks/" in file
            or "/loggers/" in file
            or "/loops/" in file
            or "/core/module" in file
        ):
            rows.append(
                (
                    cumtime / steps * 1e3,
                    tottime / steps * 1e3,
                    calls // steps,
                    f"{file.split('site-packages/')[-1].split('/work/main/')[-1]}:{line} {name}",
                )
            )
    rows.sort(reverse=True)
    lines = [f"{'cum ms/step':>12}{'own ms/step':>12}{'calls/step':>11}  function"]
    lines += [f"{c:>12.2f}{t:>12.2f}{k:>11}  {f}" for c, t, k, f in rows[:n]]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=150, help="steps per run (the first --warmup untimed)")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--profile", type=int, default=0, help="cProfile this many mmssl steps")
    parser.add_argument("--runs", default="torch,lightning,mmssl", help="also: guard (NonFiniteGuard's hook alone)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    data = batches(args.steps, args.batch_size)
    medians: dict[str, float] = {}
    report = None
    for run in args.runs.split(","):
        torch.manual_seed(0)
        if run == "torch":
            times = plain_torch(data, args.warmup)
        elif run == "lightning":
            times = plain_lightning(data, args.warmup)
        elif run == "mmssl":
            times, report = mmssl_fit(data, args.warmup, args.profile)
        elif run == "guard":
            medians.update(guard_hook())
            continue
        else:
            parser.error(f"--runs: unknown {run!r}")
        medians[run] = statistics.median(times) * 1e3
    print(
        f"\ntiny CLIP ({MODEL.name}), batch {args.batch_size}, fp32, 1 thread, {args.steps - args.warmup} timed steps"
    )
    width = max(10, *(len(run) + 2 for run in medians))
    for run, ms in medians.items():
        extra = (
            f"  (+{ms - medians['torch']:.2f} ms over torch)"
            if "torch" in medians and run in ("lightning", "mmssl")
            else ""
        )
        print(f"{run:<{width}}{ms:8.2f} ms{'' if run.startswith('guard') else '/step'}{extra}")
    if report:
        print(
            "\nmmssl run, cProfile (cumulative per step, project and Lightning loop/callback/logger code):\n" + report
        )
    return {"ms_per_step": medians, "profile": report}


if __name__ == "__main__":
    sys.exit(main() and 0)
