"""LoRA against full fine-tuning (and LiT's locked image tower) on one CLIP: what each trains and costs.

    python benchmarks/lora.py --model configs/fashion_mnist/clip_tiny_28.json --batch-size 128 --steps 20

Each mode runs in a fresh process (so that one's peak memory cannot hide another's), on the same
random batch, with mmssl's CLIP module and its loss: ``full`` (every parameter trains), ``lora``
(``model.lora: {r, alpha: r}`` on both towers: attention and MLP layers, see
``mmssl.models.lora``), ``lock.image`` (LiT: the image tower frozen, the text tower trains). Each
does ``--warmup`` untimed and ``--steps`` timed steps of forward, backward and fused AdamW.

Printed per mode: trainable / total parameters, the median step time, and peak memory: on CUDA
``torch.cuda.max_memory_allocated``; on the CPU the process's peak resident set (``ru_maxrss``)
and how far training raised it above the built model (activations, gradients, optimizer state).
``--output-json`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch

REPO = Path(__file__).resolve().parents[1]
MODES = ("full", "lora", "lock_image")


def _rss_mib() -> float:
    """Current resident set of this process (Linux ``/proc/self/statm``), MiB."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def measure(mode: str, model: str, batch_size: int, steps: int, warmup: int, rank: int, device: str,
            threads: Optional[int]) -> dict[str, Any]:
    """Build the CLIP for ``mode``, train ``warmup + steps`` steps, return the figures."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from mmssl.models.clip import CLIP

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp, "base.pth")
        torch.save(CLIP(model_name=model).model.state_dict(), base)  # the "pretrained" CLIP being adapted
        kwargs: dict[str, Any] = {"model_name": model, "pretrained": str(base)}
        if mode == "lora":
            kwargs["lora"] = {"r": rank, "alpha": rank}
        elif mode == "lock_image":
            kwargs["lock"] = {"image": True}
        module = CLIP(**kwargs).to(device).train()
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=True)
    size = module.image_size
    images = torch.randn(batch_size, 3, size, size, device=device)
    tokens = module.tokenizer([f"a photo of item {i}" for i in range(batch_size)]).to(device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    rss_before = _rss_mib()
    times = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        loss = module.contrastive_loss(module(images, tokens))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    out = {
        "mode": mode, "trainable_params": sum(p.numel() for p in params),
        "total_params": sum(p.numel() for p in module.parameters()),
        "step_ms": 1000 * statistics.median(times), "batch_size": batch_size, "device": device,
    }
    if device == "cuda":
        out["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        out.update(peak_rss_mib=peak, training_rss_mib=peak - rss_before)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    """Run every mode in its own process and print the table; the exit status."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="configs/fashion_mnist/clip_tiny_28.json",
                        help="open_clip model name or JSON config")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (alpha = rank)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads on the CPU (default: torch's)")
    parser.add_argument("--output-json", default=None, help="write the figures here")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    settings = (args.model, args.batch_size, args.steps, args.warmup, args.rank, args.device, args.threads)
    if args.child:
        print(json.dumps(measure(args.child, *settings)))
        return 0
    rows = []
    for mode in args.modes:
        cmd = [sys.executable, __file__, "--child", mode, "--model", args.model, "--batch-size", str(args.batch_size),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--rank", str(args.rank),
               "--device", args.device, *(["--threads", str(args.threads)] if args.threads else [])]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=str(REPO))
        if done.returncode:
            print(f"benchmarks/lora.py: mode {mode} failed: {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            return 1
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    memory = "peak_mib" if args.device == "cuda" else "training_rss_mib"
    print(f"{args.model}, batch {args.batch_size}, {args.device}, median of {args.steps} steps")
    print(f"{'mode':<11} {'trainable':>12} {'of total':>9} {'ms/step':>9} {'memory MiB':>11}"
          + ("" if args.device == "cuda" else f" {'peak RSS MiB':>13}"))
    for r in rows:
        share = 100 * r["trainable_params"] / r["total_params"]
        line = f"{r['mode']:<11} {r['trainable_params']:>12,} {share:>8.2f}% {r['step_ms']:>9.1f} {r[memory]:>11.0f}"
        print(line + ("" if args.device == "cuda" else f" {r['peak_rss_mib']:>13.0f}"))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
