"""Memory and speed of the model keys ``grad_checkpointing``, ``compile`` and the tower locks.

For each variant of one model (CLIP or MAE, built as ``mmssl fit`` builds it, from the model
class with the variant's keys), a fresh process trains on a random batch: forward, loss,
backward, an AdamW step. Measured after ``--warmup`` steps (the first compiles, the first step
creates the optimizer state):

- ``step_s``: median wall time of ``--steps`` steps;
- ``step_mem_mib``: on CUDA the peak allocated memory of the timed steps above what is allocated
  at rest (weights, gradients, optimizer state); on a CPU the peak resident set of the timed steps
  (the kernel's high-water mark, reset through ``/proc/self/clear_refs`` after the warm-up) above
  the resident set at rest, so allocator caching and compiled code count too;
- ``tensor_peak_mib`` (eager variants): the peak bytes of live tensor storages over one step
  (``benchmarks/gradcache.py``'s ``PeakTensorMemory``), model state included: what an
  accelerator's allocator would need, independent of the host allocator.

    python benchmarks/memory_options.py --model clip --model-name ViT-B-32 --batch 32
    python benchmarks/memory_options.py --model mae --batch 16  # MAE ViT-B/16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO)]

VARIANTS = {
    "clip": {"baseline": {}, "grad_checkpointing": {"grad_checkpointing": True}, "compile": {"compile": True},
             "lock_image": {"lock": {"image": True}}, "lock_text": {"lock": {"text": True}}},
    "mae": {"baseline": {}, "grad_checkpointing": {"grad_checkpointing": True}, "compile": {"compile": True}},
}
CAPTIONS = ["a photo of a small red circle on a white background", "a big blue square in the top left corner"]


def _build(kind: str, model_name: str, mae_kwargs: dict[str, Any], keys: dict[str, Any]):
    import torch

    torch.manual_seed(0)
    if kind == "clip":
        from mmssl.models.clip import CLIP

        return CLIP(model_name, **keys)
    from mmssl.models.mae import MAE

    return MAE(**mae_kwargs, **keys)  # default: ViT-B/16 encoder, 8-block 512-wide decoder (MAE's)


def _step_fn(kind: str, model, batch: int, device):
    import torch

    size = model.image_size
    images = torch.randn(batch, 3, size, size, device=device)
    if kind == "clip":
        tokens = model.tokenizer([CAPTIONS[i % 2] for i in range(batch)]).to(device)
        return lambda: model.contrastive_loss(model(images, tokens))
    return lambda: model(images)[0]


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def run_variant(kind: str, variant: str, model_name: str, mae_kwargs: dict[str, Any], batch: int, steps: int,
                warmup: int, device_name: str) -> dict[str, Any]:
    """One variant in this process: the figures of the module docstring."""
    import torch
    from gradcache import PeakTensorMemory

    device = torch.device(device_name)
    model = _build(kind, model_name, mae_kwargs, VARIANTS[kind][variant]).to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=device.type == "cuda" or None)
    loss_fn = _step_fn(kind, model, batch, device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn().backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    start = time.perf_counter()
    for _ in range(warmup):
        step()
    warm_s = time.perf_counter() - start
    if device.type == "cuda":
        rest = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        rest = _rss_mib()[0]
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak resident set (VmHWM) to the current one
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    if device.type == "cuda":
        step_mem = (torch.cuda.max_memory_allocated(device) - rest) / 2**20
    else:
        step_mem = _rss_mib()[1] - rest
    out = {"model": kind, "variant": variant, "device": device_name, "batch": batch, "step_s": statistics.median(times),
           "steps_s": [round(t, 3) for t in times], "warmup_s": round(warm_s, 1), "step_mem_mib": round(step_mem, 1),
           "trainable_params": sum(p.numel() for p in params), "threads": torch.get_num_threads()}
    if variant != "compile":
        tracker = PeakTensorMemory()
        with tracker:
            tracker.track(list(model.parameters()), list(model.buffers()), optimizer.state_dict())
            tracker.peak = tracker.current
            step()
        out["tensor_peak_mib"] = round(tracker.peak / 2**20, 1)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    """Every variant of ``--model``, each in a fresh process; prints a table, writes JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(VARIANTS), default="clip")
    parser.add_argument("--model-name", default="ViT-B-32", help="CLIP: open_clip name or JSON config")
    parser.add_argument("--mae-kwargs", type=json.loads, default={}, help="MAE sizes as JSON (default ViT-B/16)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--variants", nargs="*", help="a subset of the variants (default: all)")
    parser.add_argument("--output-json", help="write every variant's figures here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    common = (args.model_name, args.mae_kwargs, args.batch, args.steps, args.warmup, args.device)
    if args.child:
        print(json.dumps(run_variant(args.model, args.child, *common)))
        return 0
    rows = []
    for variant in args.variants or VARIANTS[args.model]:
        cmd = [sys.executable, __file__, "--child", variant, "--model", args.model, "--model-name", args.model_name,
               "--mae-kwargs", json.dumps(args.mae_kwargs), "--batch", str(args.batch), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--device", args.device]
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        if done.returncode:
            print(f"{variant}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
            return 1
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"{args.model:5} {variant:20} step {r['step_s']:.3f} s  step memory {r['step_mem_mib']:8.1f} MiB  "
              f"tensor peak {r.get('tensor_peak_mib', float('nan')):8.1f} MiB  warm-up {r['warmup_s']} s", flush=True)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
