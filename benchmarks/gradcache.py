"""GradCache (``model.contrastive_chunk_size``): memory and speed of a CLIP training step.

Two measurements, printed as tables and written as JSON under benchmarks/results/:

``cpu``: the tiny CLIP (configs/models/clip_tiny.json) trained for real on the CPU, fp32, one
AdamW step per iteration (forward, loss, backward, step) on a random batch, for each per-device
batch plain and chunked. Each configuration runs in a fresh process, so its peak resident set
(``ru_maxrss``) is its own; "step memory" is that peak minus the resident set just before the
first step (model, batch and interpreter already there). Speed is measured apart, in one process
that alternates plain and chunked steps on the same model after a warm-up of each (the ratio of
each pair survives a drifting load); samples/s are the medians.

``estimate``: the largest per-device batch whose training step fits a GPU memory budget, found
without a GPU: the step runs on fake tensors (``torch._subclasses.FakeTensorMode``: shapes,
dtypes and storages, no data, no compute) under a dispatch mode that adds up the bytes of every
live tensor storage, so its peak is the step's peak tensor memory, optimizer state included. The
fit rule leaves room for what it cannot see: ``peak x 1.10 + 1 GiB <= budget`` (caching-allocator
fragmentation, CUDA context and cuBLAS/cuDNN workspaces). CPU attention kernels stand in for
CUDA's, so this is an estimate: say so wherever its figures are used.

    nice -n 15 python benchmarks/gradcache.py cpu --batches 256 1024 4096 --chunk 128 --max-plain 1024
    nice -n 15 python benchmarks/gradcache.py estimate --model ViT-B-32 --chunk 256 --budget-gib 24
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import weakref
from pathlib import Path
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
GIB = 2**30


def _model(name: str, chunk: Optional[int]):
    from mmssl.models.clip import CLIP

    # Full text context (no trimming): the same work in every configuration and on every device.
    return CLIP(name, contrastive_chunk_size=chunk, trim_text_padding=False).train()


def _batch(model, batch: int, generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images and captions of 12 tokens + end-of-text, padded to the context."""
    s, length = model.image_size, model.model.context_length
    images = torch.randn(batch, 3, s, s, generator=generator)
    tokens = torch.zeros(batch, length, dtype=torch.long)
    tokens[:, 0] = 49406  # start of text
    tokens[:, 1:13] = torch.randint(1, 49000, (batch, 12), generator=generator)
    tokens[:, 13] = 49407  # end of text: the pooled position
    return images, tokens


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _step(model, optimizer, images, tokens, autocast: bool = False) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model.contrastive_loss(model(images, tokens))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run_one(model_name: str, batch: int, chunk: Optional[int], threads: int) -> dict[str, Any]:
    """Peak RSS of 2 steps of one configuration in this process (``cpu`` spawns one per config)."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = _model(model_name, chunk)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    images, tokens = _batch(model, batch)
    before = _rss_mib()
    times, cpu_times = [], []
    for _ in range(2):  # the first step also allocates the optimizer state
        start, start_cpu = time.perf_counter(), time.process_time()
        _step(model, optimizer, images, tokens)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - start_cpu)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"batch": batch, "chunk": chunk, "peak_rss_mib": round(peak, 1), "rss_before_mib": round(before, 1),
            "step_mem_mib": round(peak - before, 1), "step_times_s": [round(t, 2) for t in times],
            "step_cpu_s": [round(t, 2) for t in cpu_times]}


def run_pairs(model_name: str, batch: int, chunk: int, rounds: int, threads: int) -> dict[str, Any]:
    """Step times of plain and chunked steps alternated on one model: the ratio survives a drifting load.

    Both the wall time and this process's CPU time are taken: on a shared machine a niced process
    waits for the cores most of the time, and its CPU time (with one thread: the step's compute)
    is the figure that the other jobs do not distort.
    """
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = _model(model_name, None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    images, tokens = _batch(model, batch)
    wall: dict[str, list[float]] = {"plain": [], "chunked": []}
    cpu_s: dict[str, list[float]] = {"plain": [], "chunked": []}
    for r in range(rounds + 1):  # round 0 warms up both
        for kind in ("plain", "chunked"):
            model.contrastive_chunk_size = chunk if kind == "chunked" else None
            start, start_cpu = time.perf_counter(), time.process_time()
            _step(model, optimizer, images, tokens)
            if r:
                wall[kind].append(time.perf_counter() - start)
                cpu_s[kind].append(time.process_time() - start_cpu)
    out: dict[str, Any] = {"batch": batch, "chunk": chunk, "threads": threads}
    for name, times in (("cpu", cpu_s), ("wall", wall)):
        plain, chunked = statistics.median(times["plain"]), statistics.median(times["chunked"])
        ratios = [c / p for p, c in zip(times["plain"], times["chunked"])]
        out[name] = {"plain_step_s": round(plain, 3), "chunked_step_s": round(chunked, 3),
                     "plain_samples_per_s": round(batch / plain, 1), "chunked_samples_per_s": round(batch / chunked, 1),
                     "ratio_median": round(statistics.median(ratios), 3), "ratios": [round(x, 3) for x in ratios]}
    return out


def _spawn(*args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, cwd=REPO)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def cpu(args: argparse.Namespace) -> dict[str, Any]:
    memory, timing = [], []
    common = ["--model", args.model, "--threads", str(args.threads)]
    for batch in args.batches:
        plain_runs = not (args.max_plain and batch > args.max_plain)
        for chunk in ((None, args.chunk) if plain_runs else (args.chunk,)):
            memory.append(
                {
                    "batch": batch,
                    "chunk": chunk,
                    **_spawn("_one", *common, "--batch", str(batch), *(["--chunk", str(chunk)] if chunk else [])),
                }
            )
            print(json.dumps(memory[-1]), flush=True)
        if plain_runs:
            timing.append(_spawn("_pairs", *common, "--batch", str(batch), "--chunk", str(args.chunk),
                                 "--rounds", str(args.rounds)))
            print(json.dumps(timing[-1]), flush=True)
        else:
            print(f"batch {batch} plain: not run (--max-plain {args.max_plain}; `estimate --check {batch}` "
                  "gives its peak tensor memory)", flush=True)
    ok = [m for m in memory if "error" not in m]
    base = next((m for m in ok if m["batch"] == min(args.batches) and m["chunk"] is None), None)
    print(f"\n{args.model}, fp32, {args.threads} threads, AdamW step; chunk {args.chunk}")
    print(f"{'batch':>6} {'chunk':>6} {'peak RSS MiB':>13} {'step MiB':>9} {'x plain@' + str(min(args.batches)):>12}"
          f" {'2nd step CPU s':>15}")
    for m in memory:
        if "error" in m:
            print(f"{m['batch']:>6} {str(m['chunk']):>6} failed: {m['error']}")
            continue
        ratio = m["step_mem_mib"] / base["step_mem_mib"] if base else float("nan")
        print(f"{m['batch']:>6} {str(m['chunk']):>6} {m['peak_rss_mib']:>13.0f} {m['step_mem_mib']:>9.0f}"
              f" {ratio:>12.2f} {m['step_cpu_s'][-1]:>15.2f}")
    print(f"\n{'batch':>6} {'clock':>5} {'plain samples/s':>16} {'chunked samples/s':>18} {'chunked/plain time':>19}")
    for t in timing:
        for clock in ("cpu", "wall"):
            if "error" not in t:
                c = t[clock]
                print(
                    f"{t['batch']:>6} {clock:>5} {c['plain_samples_per_s']:>16.1f} {c['chunked_samples_per_s']:>18.1f}"
                    f" {c['ratio_median']:>19.2f}"
                )
    return {"memory": memory, "timing": timing}


class PeakTensorMemory(TorchDispatchMode):
    """Bytes of live tensor storages, and their peak, over everything dispatched inside it.

    Hand-written because torch's ``MemTracker`` (torch.distributed._tools) refuses a module that
    runs more than once per iteration, which is what chunking does. A storage is counted when an
    op first returns it and released when Python frees it (weak reference), as the caching
    allocator would see it return.
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = self.peak = 0
        self._seen: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()

    def track(self, *tensors: Any) -> None:
        for t in tree_flatten(tensors)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if st not in self._seen:
                    self._seen[st] = st.nbytes()
                    self.current += st.nbytes()
                    weakref.finalize(st, self._release, st.nbytes())
        self.peak = max(self.peak, self.current)

    def _release(self, nbytes: int) -> None:
        self.current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.track(out)
        return out


def peak_step_memory(model_name: str, batch: int, chunk: Optional[int], bf16: bool) -> int:
    """Peak tensor bytes of the second training step (the first creates the AdamW state)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch.manual_seed(0)
    model = _model(model_name, chunk)
    mode = FakeTensorMode()
    for module in model.modules():  # real weights -> fake ones of the same shapes and dtypes
        for key, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[key] = torch.nn.Parameter(mode.from_tensor(p.detach()), p.requires_grad)
        for key, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[key] = mode.from_tensor(b)
    with mode:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        images, tokens = _batch(model, batch)
        _step(model, optimizer, images, tokens, autocast=bf16)
        tracker = PeakTensorMemory()
        with tracker:
            tracker.track(list(model.parameters()), list(model.buffers()), images, tokens, optimizer.state_dict())
            tracker.peak = tracker.current
            _step(model, optimizer, images, tokens, autocast=bf16)
    return tracker.peak


def fits(peak: int, budget_gib: float) -> bool:
    return peak * 1.10 + GIB <= budget_gib * GIB


def largest_batch(model_name: str, chunk: Optional[int], bf16: bool, budget_gib: float, step: int,
                  probe: int) -> tuple[int, dict]:
    """Largest multiple of ``step`` that fits. Returns (batch, {batch: peak bytes} of every probe).

    Peak memory is a quadratic in the batch B (activations and features grow with B, the (B, B)
    logits with B^2), so three probes at 1, 2 and 4 x ``probe`` place the boundary; probes at the
    predicted batch and its neighbours then decide it (the peak may switch between the loss and
    a chunk's backward, so the fit is only the starting point).
    """
    peaks: dict[int, int] = {}

    def peak(batch: int) -> int:
        if batch not in peaks:
            peaks[batch] = peak_step_memory(model_name, batch, chunk, bf16)
            print(f"  chunk={chunk} batch={batch}: peak {peaks[batch] / GIB:.2f} GiB", flush=True)
        return peaks[batch]

    xs = [probe, 2 * probe, 4 * probe]
    a, b, c = torch.linalg.solve(torch.tensor([[1.0, x, x * x] for x in xs], dtype=torch.float64),
                                 torch.tensor([float(peak(x)) for x in xs], dtype=torch.float64)).tolist()
    limit = ((budget_gib * GIB - GIB) / 1.10 - a)  # solve c B^2 + b B = limit
    guess = (-b + (b * b + 4 * c * limit) ** 0.5) / (2 * c) if c > 0 else limit / b
    batch = max(step, int(guess) // step * step)
    while not fits(peak(batch), budget_gib) and batch > step:
        batch -= step
    while fits(peak(batch + step), budget_gib):
        batch += step
    return batch, peaks


def estimate(args: argparse.Namespace) -> dict[str, Any]:
    bf16 = args.precision == "bf16-mixed"
    result: dict[str, Any] = {"model": args.model, "precision": args.precision, "budget_gib": args.budget_gib,
                              "rule": "peak x 1.10 + 1 GiB <= budget", "chunk": args.chunk}
    for batch in args.check or []:
        for chunk in ((args.chunk,) if args.chunked_only else (None, args.chunk)):
            peak = peak_step_memory(args.model, batch, chunk, bf16)
            result.setdefault("peaks_gib", []).append(
                {"batch": batch, "chunk": chunk, "peak_gib": round(peak / GIB, 3)}
            )
            print(f"{args.model} batch {batch} chunk {chunk}: peak tensor memory {peak / 2**20:.0f} MiB", flush=True)
    if args.budget_gib:
        for chunk in (None, args.chunk):
            step = args.step if chunk is None else args.chunked_step
            probe = 8 * step if chunk is None else step  # chunked probes must hold several chunks
            batch, peaks = largest_batch(args.model, chunk, bf16, args.budget_gib, step, probe)
            result["plain" if chunk is None else "chunked"] = {
                "largest_batch": batch, "granularity": step, "peak_gib": round(peaks[batch] / GIB, 2),
                "probes_gib": {str(k): round(v / GIB, 3) for k, v in sorted(peaks.items())}}
            print(f"{args.model} {args.precision}, chunk {chunk}: largest per-device batch in {args.budget_gib} GiB "
                  f"= {batch} (multiple of {step}; peak tensor memory {peaks[batch] / GIB:.2f} GiB)", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("cpu", help="real steps of a small CLIP on the CPU")
    p.add_argument("--model", default="configs/models/clip_tiny.json")
    p.add_argument("--batches", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="timed plain/chunked pairs per batch")
    p.add_argument("--threads", type=int, default=1, help="1: a step's CPU time is its compute")
    p.add_argument(
        "--max-plain",
        type=int,
        default=0,
        help="skip plain steps above this batch (0: run all), e.g. where they would not fit a shared machine",
    )
    p.add_argument("--out", default=str(RESULTS / "gradcache_cpu.json"))
    for name in ("_one", "_pairs"):
        p = sub.add_parser(name)
        p.add_argument("--model", required=True)
        p.add_argument("--batch", type=int, required=True)
        p.add_argument("--chunk", type=int)
        p.add_argument("--rounds", type=int, default=3)
        p.add_argument("--threads", type=int, default=2)
    p = sub.add_parser("estimate", help="largest per-device batch in a memory budget, on fake tensors")
    p.add_argument("--model", default="ViT-B-32")
    p.add_argument("--precision", choices=["bf16-mixed", "32-true"], default="bf16-mixed")
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--budget-gib", type=float, default=24.0)
    p.add_argument("--step", type=int, default=32, help="batch granularity of the search without chunking")
    p.add_argument("--chunked-step", type=int, default=1024, help="batch granularity of the search with chunking")
    p.add_argument("--check", type=int, nargs="*", help="also print the peak at these batches")
    p.add_argument("--chunked-only", action="store_true", help="--check the chunked step only")
    p.add_argument("--out", default=str(RESULTS / "gradcache_vit_b32_24gib.json"))
    args = parser.parse_args()
    if args.command == "_one":
        print(json.dumps(run_one(args.model, args.batch, args.chunk, args.threads)))
        return
    if args.command == "_pairs":
        print(json.dumps(run_pairs(args.model, args.batch, args.chunk, args.rounds, args.threads)))
        return
    result = cpu(args) if args.command == "cpu" else estimate(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join(sys.argv), "torch": torch.__version__, "cpu": os.cpu_count(),
            "loadavg_at_end": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    Path(args.out).write_text(json.dumps({"meta": meta, "result": result}, indent=1) + "\n")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
