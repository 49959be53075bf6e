"""Training throughput of an mmssl config, optionally beside open_clip_train on the same run.

    python tools/benchmark.py --config configs/fashion_mnist/clip_tiny.yaml --warmup 3 --steps 20 \
        [--precision bf16-mixed] [--patch-dropout 0.5] [--compare-open-clip | --compare-lightly |
        --compare-mask-ratio 0.005] [--repeats 3] [--output-json out.json] \
        [-- --data.init_args.batch_size=32 ...]

Prints samples/s, step time, the fraction of time waiting for data, peak memory and model FLOP
utilisation over the device's matmul peak, measured right before and after the timed steps (no
figure, and a note why, where the model outran that probe), and a warning when the run is on a
CPU in bf16 that runs bf16 slower than fp32); with --compare-open-clip (CLIP) or
--compare-lightly (MAE) also the peer's figures and the ratio; with --compare-mask-ratio R the
MAE speed-up of the config's mask ratio over R beside the FLOP ratio of the two runs.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from pathlib import Path

from mmssl.tools._common import add_output_json, run

# The harness lives in a clone's benchmarks/ beside the package: mmssl never imports it and the
# wheel does not ship it. Only a clone's root goes on sys.path (an installed tool's parents[1] is
# the mmssl package, whose subpackages must not become top-level modules).
_ROOT = Path(__file__).resolve().parents[1]
if (_ROOT / "benchmarks" / "bench.py").is_file() and str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))
try:
    from benchmarks.bench import benchmark, cpu_bf16_warning, format_report
except ModuleNotFoundError as err:
    if err.name != "benchmarks":
        raise
    benchmark = cpu_bf16_warning = format_report = None  # an installed mmssl: _run says so


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print its report (and write ``--output-json``); the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="mmssl YAML config")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (>= 1)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--precision", help="Lightning precision (32-true, bf16-mixed, 16-mixed...)")
    parser.add_argument("--accelerator", help="cpu, gpu or auto (default: the config's)")
    parser.add_argument("--batch-size", type=int, help="per-device batch size (data.init_args.batch_size)")
    parser.add_argument("--patch-dropout", type=float, help="drop this fraction of image patches (both tools)")
    parser.add_argument("--flip", type=float, help="mmssl's FLIP mask ratio vs open_clip's --force-patch-dropout")
    parser.add_argument("--compare-open-clip", action="store_true", help="also run open_clip_train")
    parser.add_argument("--compare-lightly", action="store_true", help="also train lightly's MAE (MAE configs)")
    parser.add_argument("--compare-mask-ratio", type=float,
                        help="also run at this MAE mask ratio; report the speed-up and the FLOP ratio")
    parser.add_argument("--repeats", type=int, default=1, help="alternate the pair this many times; median ratio")
    add_output_json(parser, "--json", help="write the figures here as JSON")
    parser.add_argument("overrides", nargs="*", help="further mmssl CLI arguments, after --")
    args = parser.parse_args(argv)
    return run("benchmark", lambda: _run(args))


def _run(args: argparse.Namespace) -> None:
    if benchmark is None:
        raise FileNotFoundError(errno.ENOENT, "the benchmark harness is in a clone of the mmssl repository only "
                                "(not in the installed package): run python tools/benchmark.py there", "benchmarks/")
    if not os.path.isfile(args.config):  # before any model or peer is built
        raise FileNotFoundError(errno.ENOENT, "--config: no such file", args.config)
    overrides = list(args.overrides)
    if args.precision:
        overrides.append(f"--trainer.precision={args.precision}")
    if args.accelerator:
        overrides.append(f"--trainer.accelerator={args.accelerator}")
    if args.batch_size:
        overrides.append(f"--data.init_args.batch_size={args.batch_size}")
    result = benchmark(args.config, overrides, args.warmup, args.steps, args.compare_open_clip, args.patch_dropout,
                       args.repeats, args.flip, args.compare_lightly, args.compare_mask_ratio)
    print(format_report(result))
    warning = cpu_bf16_warning(result)
    if warning:
        result["warning"] = warning
        print(warning, file=sys.stderr)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1:])
