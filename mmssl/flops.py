"""The project's one FLOP counter, and where a run records what it counted.

Ground floor (torch only): the run summary counts a training step with it, the scaling fit reads
the figure back, and the benchmarks in ``benchmarks/`` count with the same code.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

# Written by ``mmssl.callbacks.RunSummary`` into the run folder, read by ``mmssl.visualize.scaling``.
COMPUTE_FILE = "compute.json"


@contextlib.contextmanager
def count_flops() -> Iterator[FlopCounterMode]:
    """Count the FLOPs of the code inside.

    torch's ``FlopCounterMode`` with the math attention backend: FlopCounterMode has no formula
    for the CPU flash-attention op, and the math backend decomposes attention into the matmuls
    it does count. Only the counted code runs with the math backend.

    Yields:
        The counter; ``counter.get_total_flops()`` once the block has ended.
    """
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        yield counter
