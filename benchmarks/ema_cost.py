"""What an EMA of the weights (``mmssl.callbacks.EMA``) costs: memory and step time.

    python benchmarks/ema_cost.py --model clip --batch-size 32 --steps 20 --repeats 5
    python benchmarks/ema_cost.py --model mae --batch-size 64 --steps 20 --repeats 5

Builds the demo CLIP (``configs/models/clip_tiny.json``) or the demo MAE (``configs/demo/mae.yaml``'s
sizes), and times a training step (forward, backward, AdamW step) without and with the EMA update
that the callback runs after each step (torch's ``AveragedModel`` with the callback's foreach
update), alternating the two ``--repeats`` times, and the update alone; prints the median step
times, the overhead, the
bytes of the averaged copy against the model's parameters, and on CUDA the allocated memory the
copy adds. Random inputs: the figures are the model's, not the loader's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.optim.swa_utils import AveragedModel

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from mmssl.callbacks import EMA  # noqa: E402

MAE_DEMO = dict(image_size=32, patch_size=4, embed_dim=128, depth=4, num_heads=4, decoder_embed_dim=96,
                decoder_depth=2, decoder_num_heads=4, mask_ratio=0.75, norm_pix_loss=True)


def build(model: str) -> tuple[torch.nn.Module, callable]:
    """The module and a function of the batch size returning (module -> loss) for one step."""
    if model == "clip":
        from mmssl.models.clip import CLIP

        module = CLIP(model_name=str(_ROOT / "configs/models/clip_tiny.json"))

        def loss(batch: int, device: torch.device):
            images = torch.randn(batch, 3, 32, 32, device=device)
            text = torch.randint(1, 49407, (batch, 24), device=device)
            return lambda: module.contrastive_loss(module(images, text))
        return module, loss
    from mmssl.models.mae import MAE

    module = MAE(**MAE_DEMO)

    def loss(batch: int, device: torch.device):
        images = torch.randn(batch, 3, 32, 32, device=device)
        return lambda: module(images)[0]
    return module, loss


def tensor_bytes(module: torch.nn.Module) -> tuple[int, int]:
    """Bytes of the parameters, and of parameters and buffers, of ``module``."""
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    return params, params + sum(b.numel() * b.element_size() for b in module.buffers())


def timed(step, sync, steps: int) -> float:
    """Median seconds of ``steps`` calls of ``step``."""
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    """Measure and print; the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("clip", "mae"), default="clip")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per repeat and variant")
    parser.add_argument("--repeats", type=int, default=5, help="alternations of without / with EMA")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output-json", help="also write the figures here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    module, make_loss = build(args.model)
    module.to(device).train()
    loss = make_loss(args.batch_size, device)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    ema = EMA(decay=0.999)
    average = AveragedModel(module, device=device, use_buffers=True, multi_avg_fn=ema.update_average)
    added = (torch.cuda.memory_allocated(device) - before) if device.type == "cuda" else None

    def train_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss().backward()
        optimizer.step()

    def ema_step() -> None:
        train_step()
        average.update_parameters(module)

    for _ in range(3):  # warm-up: allocator, optimizer state, the first (copying) update
        ema_step()
    plain, with_ema, update = [], [], []
    for _ in range(args.repeats):
        plain.append(timed(train_step, sync, args.steps))
        with_ema.append(timed(ema_step, sync, args.steps))
        update.append(timed(lambda: average.update_parameters(module), sync, args.steps))
    params, total = tensor_bytes(module)
    copy_params, copy_total = tensor_bytes(average.module)
    result = {
        "model": args.model, "device": str(device), "batch_size": args.batch_size,
        "parameters": sum(p.numel() for p in module.parameters()),
        "param_bytes": params, "ema_copy_bytes": copy_total, "ema_copy_over_params": copy_total / params,
        "cuda_allocated_by_ema": added,
        "step_s": statistics.median(plain), "step_with_ema_s": statistics.median(with_ema),
    }
    result["ema_overhead"] = result["step_with_ema_s"] / result["step_s"] - 1
    result["update_s"] = statistics.median(update)  # the EMA update alone: robust to a busy machine
    print(f"{args.model} on {device}, batch {args.batch_size}: {result['parameters'] / 1e6:.2f}M parameters "
          f"({params / 2**20:.1f} MiB); EMA copy {copy_total / 2**20:.1f} MiB "
          f"({result['ema_copy_over_params']:.3f}x the parameters)"
          + (f", CUDA allocated +{added / 2**20:.1f} MiB" if added is not None else ""))
    print(f"step {result['step_s'] * 1e3:.1f} ms, with EMA {result['step_with_ema_s'] * 1e3:.1f} ms "
          f"({result['ema_overhead'] * 100:+.1f}%); the update alone {result['update_s'] * 1e3:.2f} ms "
          f"({result['update_s'] / result['step_s'] * 100:.2f}% of a step); medians of {args.repeats} x {args.steps} "
          "steps each")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
