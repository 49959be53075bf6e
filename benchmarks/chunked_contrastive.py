"""Chunked contrastive losses (``model.init_args.objectives.contrastive.chunk_size``): what one
training step of the loss keeps for its backward, dense against chunked, as the global batch grows.

One rank's view of a data-parallel step: this rank's B rows (image and text features, (B, D))
against the N = B x ranks gathered columns, as :func:`mmssl.objectives.contrastive_loss` builds
them (the gather itself left out: one process). For each loss, number of ranks and variant, one
forward and backward runs on the CPU under ``torch.autograd.graph.saved_tensors_hooks``, which
sees every tensor autograd saves (the chunked losses' ``save_for_backward`` included): "saved" is
the bytes of those tensors, each storage once, apart from tensors with a feature dimension D (the
towers' outputs, the gathered columns, their scaled or autocast copies: (B, D) and (N, D), which
both variants keep alike); "largest block" is the largest tensor without a feature dimension that
any op of the forward or the backward produced (a dispatch mode sees them all): the (B, N)
logits, or a (B, chunk) block. With ``--repeats R``, the median time of R steps of each variant
too (on a quiet machine only: a shared one's load swamps the difference).

Then the arithmetic for the issue's case, B = 32,768 global on 8 and 64 GPUs: per rank, the bytes
of the (B / GPUs, N) logits and of their gradient, what the dense loss saves (its measured bytes
per logit times the logits), and the chunked loss's (B / GPUs, chunk) block; fp32, and bf16 under
autocast (where the softmax and the sigmoid still run in fp32, as measured).

    python benchmarks/chunked_contrastive.py --rows 512 --ranks 1 2 4 8 16 --dim 768 --chunk 512
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

MIB = 2**20


class _LargestBlock(TorchDispatchMode):
    """The most elements of any op output, in the forward and the backward, with no dimension ``d``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.d, self.largest = d, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and self.d not in t.shape:
                self.largest = max(self.largest, t.numel())
        return out


def _features(rows: int, n: int, dim: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    image = F.normalize(torch.randn(n, dim, generator=g), dim=-1)  # (N, D): every rank's, this rank first
    text = F.normalize(image + torch.randn(n, dim, generator=g), dim=-1)  # (N, D)
    return {"image": image.requires_grad_(), "text": text.requires_grad_(),
            "scale": torch.tensor(10.0, requires_grad=True), "bias": torch.tensor(-10.0, requires_grad=True)}


def _step(loss: str, inputs: dict[str, torch.Tensor], rows: int, chunk: Optional[int]) -> None:
    from mmssl.losses import clip_loss, siglip_loss

    image, text, scale = inputs["image"], inputs["text"], inputs["scale"]
    if loss == "clip":
        value = clip_loss(image[:rows], text[:rows], scale, image, text, 0, chunk_size=chunk)
    else:
        value = siglip_loss(image[:rows], text[:rows], scale, inputs["bias"], text, 0, chunk_size=chunk)
    value.backward()


def measure(loss: str, rows: int, n: int, dim: int, chunk: Optional[int], bf16: bool = False) -> dict[str, float]:
    """Saved bytes (features apart) and the largest block of one step; ``bf16``: under CPU autocast."""
    inputs = _features(rows, n, dim)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if dim not in t.shape:  # not a feature tensor, nor its copy in another dtype or scale
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    spy = _LargestBlock(dim)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), spy:
            _step(loss, inputs, rows, chunk)
    return {"saved": sum(saved.values()), "largest": spy.largest}


def timed(loss: str, rows: int, n: int, dim: int, chunk: Optional[int], repeats: int) -> float:
    inputs = _features(rows, n, dim)
    _step(loss, inputs, rows, chunk)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        _step(loss, inputs, rows, chunk)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _mib(nbytes: float) -> str:
    return f"{nbytes / MIB:.2f} MiB" if nbytes >= MIB / 100 else f"{nbytes:.0f} B"


def table(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Print the measured table; return each loss's dense bytes saved per logit entry (fp32, bf16)."""
    print(f"rows per rank B = {args.rows}, feature width D = {args.dim}, chunk = {args.chunk}, fp32, one CPU process")
    timing = args.repeats > 0
    print("| loss | ranks | global batch N | saved, dense | saved, chunked | largest block, dense | "
          "largest block, chunked |" + (" step, dense | step, chunked |" if timing else ""))
    print("| --- " * (9 if timing else 7) + "|")
    per_entry: dict[str, dict[str, float]] = {}
    for loss in args.losses:
        for ranks in args.ranks:
            n = args.rows * ranks
            dense, chunked = (measure(loss, args.rows, n, args.dim, c) for c in (None, args.chunk))
            row = (f"| {loss} | {ranks} | {n} | {_mib(dense['saved'])} | {_mib(chunked['saved'])} | "
                   f"{args.rows} x {dense['largest'] // args.rows} | {args.rows} x {chunked['largest'] // args.rows} |")
            if timing:
                seconds = [timed(loss, args.rows, n, args.dim, c, args.repeats) for c in (None, args.chunk)]
                row += f" {seconds[0] * 1e3:.0f} ms | {seconds[1] * 1e3:.0f} ms |"
            print(row)
        # Bytes the dense loss saves per logit entry: the growth of its saved bytes from N to 2N
        # columns over the B x N entries added (what does not grow with N, e.g. the (B, D)
        # scaled rows, drops out).
        rows, n = args.rows, args.rows * 2
        per_entry[loss] = {name: (measure(loss, rows, 2 * n, args.dim, None, bf16=name == "bf16")["saved"]
                                  - measure(loss, rows, n, args.dim, None, bf16=name == "bf16")["saved"]) / (rows * n)
                           for name in ("fp32", "bf16")}
    return per_entry


def arithmetic(per_entry: dict[str, dict[str, float]], global_batch: int, gpus: list[int], chunk: int) -> None:
    print(f"\nB = {global_batch:,} global, chunk {chunk}: per rank, (B / GPUs) rows against N = {global_batch:,} "
          "columns")
    print("| GPUs | rows per rank | dtype | logits (rows x N) | their gradient | dense loss saves (CLIP / SigLIP) | "
          "chunked block (rows x chunk) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for count in gpus:
        rows = global_batch // count
        for dtype, size in (("fp32", 4), ("bf16", 2)):
            logits = rows * global_batch * size
            saves = " / ".join(_mib(per_entry[loss][dtype] * rows * global_batch) for loss in ("clip", "siglip")
                               if loss in per_entry)
            print(f"| {count} | {rows:,} | {dtype} | {_mib(logits)} | {_mib(logits)} | {saves} | "
                  f"{_mib(rows * chunk * size)} |")
    print("(dense: bytes saved per logit entry, measured: "
          + ", ".join(f"{loss} {v['fp32']:.1f} fp32 / {v['bf16']:.1f} bf16" for loss, v in per_entry.items()) + ")")


def parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=512, help="rows per rank (the per-device batch B)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8, 16],
                        help="numbers of ranks: N = rows x ranks")
    parser.add_argument("--dim", type=int, default=768, help="feature width D (ViT-L/14's; unlike any other size)")
    parser.add_argument("--chunk", type=int, default=512, help="columns per block of the chunked loss")
    parser.add_argument("--losses", nargs="+", default=["clip", "siglip"], choices=["clip", "siglip"])
    parser.add_argument("--repeats", type=int, default=0, help="timed steps per variant (median); 0: no timing")
    parser.add_argument("--global-batch", type=int, default=32768, help="the arithmetic's global batch")
    parser.add_argument("--gpus", type=int, nargs="+", default=[8, 64], help="the arithmetic's GPU counts")
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse(argv)
    sizes = {args.rows, args.chunk, *(args.rows * r for r in (*args.ranks, 2, 4))}
    if args.dim in sizes:  # a tensor is told apart from the features by having no dimension D
        raise SystemExit(f"--dim {args.dim}: choose a width unlike the rows, the chunk and every N ({sorted(sizes)})")
    arithmetic(table(args), args.global_batch, args.gpus, args.chunk)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
