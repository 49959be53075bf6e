"""CLIP_benchmark as the peer of ``tools/evaluate.py``: its own ``clip_benchmark`` command, on a CPU.

Run as ``python benchmarks/clip_benchmark_peer.py eval --dataset wds/NAME ...`` with the Python of a
venv that has ``clip-benchmark==1.6.2`` (and ``numpy<2.3``, which its ``accuracy`` needs). On a
machine with CUDA it is ``clip_benchmark`` itself. Without CUDA, its ``linear_probe.evaluate``
asserts ``device == 'cuda'`` and calls ``.cuda()`` (its comment: "need to use cuda for this else
too slow"); the launcher runs that one function on the CPU instead, without editing the installed
package: the function is called with ``device="cuda"`` while ``Tensor.to("cuda")`` maps to the
CPU and ``Tensor.cuda`` / ``Module.cuda`` return their object (``DataParallel`` with no GPUs is the
module itself). Nothing else of CLIP_benchmark changes: zero-shot and retrieval run as they are.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, Iterator


def _cpu(device: Any) -> Any:
    return "cpu" if isinstance(device, str) and device.startswith("cuda") else device


@contextlib.contextmanager
def cuda_on_cpu() -> Iterator[None]:
    """Inside: ``"cuda"`` devices mean the CPU for ``Tensor.to``, ``.cuda()`` is a no-op."""
    import torch

    to, tensor_cuda, module_cuda = torch.Tensor.to, torch.Tensor.cuda, torch.nn.Module.cuda

    def tensor_to(self, *args, **kwargs):
        args = tuple(_cpu(a) for a in args)
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        return to(self, *args, **kwargs)

    torch.Tensor.to = tensor_to
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.nn.Module.cuda = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.Tensor.to, torch.Tensor.cuda, torch.nn.Module.cuda = to, tensor_cuda, module_cuda


def patch_linear_probe() -> None:
    """Make ``clip_benchmark.metrics.linear_probe.evaluate`` run on the CPU (see the module docstring)."""
    import torch
    from clip_benchmark import cli
    from clip_benchmark.metrics import linear_probe

    if torch.cuda.is_available():
        return
    evaluate = linear_probe.evaluate

    @functools.wraps(evaluate)
    def on_cpu(*args, **kwargs):
        kwargs["device"] = "cuda"
        with cuda_on_cpu():
            return evaluate(*args, **kwargs)

    linear_probe.evaluate = on_cpu
    cli.linear_probe.evaluate = on_cpu


def main(argv: list[str]) -> int:
    """``clip_benchmark ARGV`` with the CPU linear probe."""
    patch_linear_probe()
    from clip_benchmark import cli

    sys.argv = ["clip_benchmark", *argv]
    return int(cli.main() or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
