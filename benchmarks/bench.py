"""Benchmark a config's training step through ``mmssl fit``'s own loop, and against open_clip_train.

``tools/benchmark.py`` is the command line; these functions are its body, importable by tests
(``benchmarks`` is imported with the repository root on ``sys.path``; ``mmssl`` never imports it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import open_clip
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint

from benchmarks.lightly_peer import run_lightly
from benchmarks.meter import PeakProbe, StepTimer, matmul_peak_flops, model_flop_utilisation, peak_memory
from benchmarks.open_clip_peer import parse_peer_log, peer_args
from mmssl.cli import MMSSLCLI
from mmssl.data.sources import expand_urls


def _model_name(config: str, overrides: list[str]) -> str:
    """``model.init_args.model_name`` as the CLI would resolve it (last override wins)."""
    name = None
    for arg in overrides:
        if arg.startswith("--model.init_args.model_name="):
            name = arg.split("=", 1)[1]
    if name is None:
        with open(config) as f:
            name = (yaml.safe_load(f).get("model") or {}).get("init_args", {}).get("model_name")
    if not name:
        raise ValueError(
            f"{config}: --patch-dropout / --compare-open-clip need a CLIP config with model.init_args.model_name"
        )
    return name


def with_patch_dropout(model_name: str, ratio: float, folder: str) -> str:
    """Write a copy of an open_clip model config with ``vision_cfg.patch_dropout = ratio``.

    open_clip's ``PatchDropout`` keeps a random ``1 - ratio`` of the image tokens in training (FLIP,
    Li et al. 2023); it is what open_clip_train's ``--force-patch-dropout`` switches on, so both
    tools drop tokens with the same code.

    Args:
        model_name: open_clip model name or JSON config path.
        ratio: fraction of patches dropped, in [0, 1).
        folder: where the new JSON goes.

    Returns:
        Path of the new JSON config (its stem is a new open_clip model name).
    """
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"--patch-dropout must be in [0, 1), got {ratio}")
    if model_name.endswith(".json"):
        with open(model_name) as f:
            cfg = json.load(f)
        stem = Path(model_name).stem
    else:
        cfg = open_clip.get_model_config(model_name)
        if cfg is None:
            raise ValueError(f"model_name {model_name!r} is not an open_clip model config")
        stem = model_name
    cfg["vision_cfg"]["patch_dropout"] = ratio
    path = os.path.join(folder, f"{stem}_pd{int(round(ratio * 100))}.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def make_cli(config: str, overrides: list[str], max_steps: int, root: str) -> MMSSLCLI:
    """``mmssl fit``'s CLI for ``config`` with validation, bars and summaries off, not yet run."""
    args = [
        "--config", config, *overrides,
        f"--trainer.max_steps={max_steps}", "--trainer.max_epochs=-1",
        # Training throughput only: no validation, no sanity check, no bar redrawing.
        "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        # The StepTimer counts one step's FLOPs; RunSummary's own count of step 0 would run a
        # second step under the slow counting mode (seconds at ViT-B on a CPU).
        "--summary.count_flops=false",
        f"--trainer.default_root_dir={root}",
    ]
    # cli_main's settings, but run=False so callers add callbacks (the timer) before fitting.
    argv, sys.argv = sys.argv, sys.argv[:1]  # the CLI warns when sys.argv holds the tool's own flags
    try:
        return MMSSLCLI(
            model_class=pl.LightningModule, datamodule_class=pl.LightningDataModule,
            subclass_mode_model=True, subclass_mode_data=True, save_config_kwargs={"overwrite": True},
            trainer_defaults={"default_root_dir": "runs"}, args=args, run=False,
        )
    finally:
        sys.argv = argv


def run_mmssl(config: str, overrides: list[str], warmup: int, steps: int, root: str) -> dict[str, Any]:
    """Run ``warmup + steps`` training steps of ``config`` through Lightning and measure them.

    Args:
        config: mmssl YAML config.
        overrides: further CLI arguments (``--data.init_args.batch_size=32``...), applied after it.
        warmup: untimed steps first (the last of them counts FLOPs).
        steps: timed steps.
        root: run folder root (the caller deletes it).

    Returns:
        The figures (see :func:`summarise`) plus the resolved ``batch_size``, ``num_workers``,
        ``shards``, ``precision``, ``device``.
    """
    cli = make_cli(config, overrides, warmup + steps, root)
    # A recipe's ModelCheckpoint(save_last=True) would write the whole state (1.8 GB at ViT-B-32
    # with AdamW) when the few timed steps end: throughput only, so no checkpoint is written.
    cli.trainer.callbacks[:] = [c for c in cli.trainer.callbacks if not isinstance(c, ModelCheckpoint)]
    device = cli.trainer.strategy.root_device
    precision = str(cli.trainer.precision)
    timer = StepTimer(warmup, device, PeakProbe(device, precision))
    cli.trainer.callbacks.append(timer)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    if len(timer.times.step) < steps:
        raise RuntimeError(f"only {len(timer.times.step)} of {steps} timed steps ran; the data stream ended early")
    out = summarise(timer, device, precision)
    dm = cli.datamodule
    out.update(
        tool="mmssl", config=config, precision=precision, batch_size=dm.batch_size,
        num_workers=dm.num_workers, shards=expand_urls(dm.train_data),
    )
    return out


def summarise(timer: StepTimer, device: torch.device, precision: str) -> dict[str, Any]:
    """Turn a :class:`StepTimer`'s record into the reported figures.

    Returns:
        ``samples_per_s``, ``step_time_s`` (median), ``data_wait_fraction``, ``peak_memory_bytes``
        and its kind, ``flops_per_step``, ``model_flops_per_s``, ``matmul_peak_flops`` (the best
        repeat of the timer's probe, else one measured now), ``peak_probes`` (each measurement),
        ``mfu`` (model FLOP/s over that peak at the same precision; ``None`` where it would exceed
        1: the probe missed the peak), ``device``, ``steps``.
    """
    t = timer.times
    total = sum(t.step)
    kind, mem = peak_memory(device, timer.peak_rss)
    probe = timer.probe
    if probe is None or not probe.measurements:
        probe = PeakProbe(device, precision)
        probe.measure()
    peak = probe.best
    flops = timer.flops_per_step or 0
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{torch.get_num_threads()} threads"
    return {
        "device": name, "device_type": device.type, "steps": len(t.step),
        "samples_per_s": sum(t.batch_size) / total,
        "step_time_s": sorted(t.step)[len(t.step) // 2],
        "data_wait_fraction": sum(t.data_wait) / total,
        "peak_memory_kind": kind, "peak_memory_bytes": mem,
        "flops_per_step": flops, "model_flops_per_s": flops * len(t.step) / total,
        "matmul_peak_flops": peak, "peak_probes": list(probe.measurements),
        "mfu": model_flop_utilisation(flops, len(t.step), total, peak),
    }


def run_open_clip(
    mine: dict[str, Any], model_name: str, warmup: int, steps: int, root: str, patch_dropout: Optional[float] = None
) -> dict[str, Any]:
    """Run open_clip_train on the shards, model, batch, workers, precision and device of ``mine``.

    Its log folder lies under ``root``, which the caller deletes; the checkpoint it would write at
    the end (after the timed steps) is skipped (the launcher's ``--no-checkpoint``).

    Returns:
        ``samples_per_s``, ``step_time_s``, ``data_wait_fraction``, ``steps``, ``command``.
    """
    launcher = [sys.executable, "-m", "benchmarks.open_clip_peer", "--no-checkpoint"]
    name = model_name
    if model_name.endswith(".json"):
        launcher += ["--model-config", model_name]
        name = Path(model_name).stem
    args = peer_args(
        name, mine["shards"], (warmup + steps) * mine["batch_size"], mine["batch_size"],
        mine["num_workers"], mine["precision"], os.path.join(root, "open_clip_logs"), patch_dropout,
    )
    env = dict(os.environ)
    # The launcher is benchmarks.open_clip_peer of this checkout (and imports its mmssl).
    package_root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    if mine["device_type"] == "cpu" and torch.cuda.is_available():
        env["CUDA_VISIBLE_DEVICES"] = ""  # same device as ours: it picks CUDA whenever it can
    command = [*launcher, "--", *args]
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        tail = "\n".join(log.splitlines()[-20:])
        hint = " (open_clip_train imports pandas: pip install 'mmssl[bench]')" if "pandas" in log else ""
        raise RuntimeError(f"open_clip_train exited with {proc.returncode}{hint}; its output ended:\n{tail}")
    out = parse_peer_log(log, warmup)
    out.update(tool="open_clip_train", command=" ".join(command))
    return out


def benchmark(
    config: str,
    overrides: list[str],
    warmup: int,
    steps: int,
    compare_open_clip: bool = False,
    patch_dropout: Optional[float] = None,
    repeats: int = 1,
    flip: Optional[float] = None,
    compare_lightly: bool = False,
    compare_mask_ratio: Optional[float] = None,
) -> dict[str, Any]:
    """Measure mmssl on ``config`` and, optionally, a peer on the same run.

    Args:
        config: mmssl YAML config.
        overrides: extra CLI arguments for mmssl (the peer gets the resolved values).
        warmup: untimed steps.
        steps: timed steps.
        compare_open_clip: also run open_clip_train (CLIP configs) and report mmssl / open_clip.
        patch_dropout: drop this fraction of image patches in both (open_clip's PatchDropout).
        repeats: run the pair this many times, alternating (A B A B ...), so a machine whose
            speed drifts (shared CPUs) affects both alike; the ratio is the median of the pairs'.
        flip: mmssl's own FLIP masking (``model.init_args.flip.mask_ratio``) against open_clip's
            ``--force-patch-dropout`` at the same ratio.
        compare_lightly: also train lightly's MAE (MAE configs) with the same sizes, data,
            optimizer and precision (``benchmarks/lightly_peer.py``); report mmssl / lightly.
        compare_mask_ratio: also run mmssl with ``model.init_args.mask_ratio`` at this value
            (e.g. 0.005: one patch in 196 masked, MAE's loss needs one) and report the speed-up of
            the config's ratio over it beside the FLOP ratio of the two, both measured.

    Returns:
        ``{"mmssl": {...}, PEER: {...}?, "ratio": float?, "pair_ratios": [...]?, "runs": [...]}``
        with PEER ``open_clip_train``, ``lightly`` or ``mmssl_mask_ratio``: the figures of the
        median run of each, and every run in ``runs``. For the mask-ratio comparison ``ratio`` is
        the speed-up and ``flop_ratio`` the FLOPs of the other run over the config's.
    """
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    if sum(map(bool, (compare_open_clip, compare_lightly, compare_mask_ratio is not None))) > 1:
        raise ValueError("choose one of --compare-open-clip, --compare-lightly, --compare-mask-ratio")
    root = tempfile.mkdtemp(prefix="mmssl_bench_")
    try:
        model_name = None
        if compare_open_clip or patch_dropout:
            model_name = _model_name(config, overrides)
        if patch_dropout:
            model_name = with_patch_dropout(model_name, patch_dropout, root)
            overrides = [*overrides, f"--model.init_args.model_name={model_name}"]
        if flip:
            overrides = [*overrides, f"--model.init_args.flip.mask_ratio={flip}"]
        runs: list[dict[str, Any]] = []
        for i in range(repeats):
            mine = run_mmssl(config, overrides, warmup, steps, os.path.join(root, f"mmssl{i}"))
            pair = {"mmssl": mine}
            if compare_open_clip:
                pair["open_clip_train"] = run_open_clip(
                    mine, model_name, warmup, steps, os.path.join(root, f"peer{i}"), flip
                )
            elif compare_lightly:
                cli = make_cli(config, overrides, warmup + steps, os.path.join(root, f"peer{i}"))
                pair["lightly"] = run_lightly(cli, warmup, steps)
            elif compare_mask_ratio is not None:
                other = [*overrides, f"--model.init_args.mask_ratio={compare_mask_ratio}"]
                pair["mmssl_mask_ratio"] = run_mmssl(config, other, warmup, steps, os.path.join(root, f"peer{i}"))
                pair["mmssl_mask_ratio"]["mask_ratio"] = compare_mask_ratio
            peer = next((k for k in PEERS if k in pair), None)
            if peer is not None:
                pair["ratio"] = mine["samples_per_s"] / pair[peer]["samples_per_s"]
            runs.append(pair)
        result = _median_of(runs)
        if "mmssl_mask_ratio" in result:
            result["flop_ratio"] = result["mmssl_mask_ratio"]["flops_per_step"] / max(
                1, result["mmssl"]["flops_per_step"]
            )
        return result
    finally:
        shutil.rmtree(root, ignore_errors=True)


PEERS = ("open_clip_train", "lightly", "mmssl_mask_ratio")


def _median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median run of each tool (by samples/s) and the median of the pairs' ratios."""
    def median_run(tool: str) -> dict[str, Any]:
        ordered = sorted((r[tool] for r in runs), key=lambda m: m["samples_per_s"])
        return ordered[(len(ordered) - 1) // 2]

    result: dict[str, Any] = {"mmssl": median_run("mmssl"), "runs": runs}
    peer = next((k for k in PEERS if k in runs[0]), None)
    if peer is not None:
        ratios = sorted(r["ratio"] for r in runs)
        result[peer] = median_run(peer)
        result["peer"] = peer
        result["pair_ratios"] = [r["ratio"] for r in runs]
        mid = len(ratios) // 2
        result["ratio"] = ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2
    return result


def bf16_advice(fp32_flops: float, bf16_flops: float) -> Optional[str]:
    """A warning when this CPU runs bf16 matmuls slower than fp32 ones, else ``None``.

    CPUs without AMX or AVX512-BF16 (AVX2-only ones, such as the 2-core EPYC of the README's
    figures) emulate bf16 matmuls, ~40x slower than fp32; AMX CPUs (Sapphire Rapids and later) and
    GPUs run them faster. Measured, not guessed from the CPU's flags.

    Args:
        fp32_flops: measured fp32 matmul FLOP/s.
        bf16_flops: measured bf16 matmul FLOP/s.
    """
    if bf16_flops >= fp32_flops:
        return None
    return (f"WARNING: bf16 matmuls run {fp32_flops / bf16_flops:.1f}x slower than fp32 on this CPU "
            f"({bf16_flops / 1e9:.1f} vs {fp32_flops / 1e9:.1f} GFLOP/s measured): train it with "
            f"--trainer.precision=32-true (bf16 pays off on AMX CPUs and GPUs)")


def cpu_bf16_warning(result: dict[str, Any]) -> Optional[str]:
    """:func:`bf16_advice` for a CPU run at a bf16 precision (measured now, 256-wide matmuls); else ``None``."""
    m = result["mmssl"]
    if m["device_type"] != "cpu" or not str(m["precision"]).startswith("bf16"):
        return None
    cpu = torch.device("cpu")
    return bf16_advice(matmul_peak_flops(cpu, "32-true", size=256, repeats=3),
                       matmul_peak_flops(cpu, "bf16-mixed", size=256, repeats=3))


def format_report(result: dict[str, Any]) -> str:
    """A readable table of :func:`benchmark`'s result."""
    m = result["mmssl"]
    lines = [
        f"device: {m['device']}  precision: {m['precision']}  batch: {m['batch_size']}  "
        f"workers: {m['num_workers']}  timed steps: {m['steps']}",
        f"{'tool':<16}{'samples/s':>11}{'step (ms)':>11}{'data wait':>11}",
        f"{'mmssl':<16}{m['samples_per_s']:>11.1f}{m['step_time_s'] * 1e3:>11.1f}{m['data_wait_fraction']:>10.1%}",
    ]
    peer = result.get("peer")
    if peer is not None:
        p = result[peer]
        label = f"mmssl mask {p['mask_ratio']}" if peer == "mmssl_mask_ratio" else peer
        lines.append(
            f"{label:<16}{p['samples_per_s']:>11.1f}{p['step_time_s'] * 1e3:>11.1f}{p['data_wait_fraction']:>10.1%}"
        )
        pairs = ", ".join(f"{r:.2f}" for r in result.get("pair_ratios", []))
        pairs = f" (median of pairs: {pairs})" if len(result.get("pair_ratios", [])) > 1 else ""
        if peer == "mmssl_mask_ratio":
            flop_ratio = result["flop_ratio"]
            lines.append(f"speed-up over mask {p['mask_ratio']}: {result['ratio']:.2f}x{pairs}; FLOP ratio "
                         f"{flop_ratio:.2f}x; speed-up / FLOP ratio: {result['ratio'] / flop_ratio:.0%}")
        else:
            lines.append(f"ratio mmssl / {peer}: {result['ratio']:.2f}x{pairs}")
    lines += [
        f"peak memory ({m['peak_memory_kind']}): {m['peak_memory_bytes'] / 2**20:.0f} MiB",
        f"FLOPs per step: {m['flops_per_step'] / 1e9:.2f} GFLOP; matmul peak at {m['precision']}: "
        f"{m['matmul_peak_flops'] / 1e9:.1f} GFLOP/s (best repeat of {len(m.get('peak_probes', [])) or 1} probes "
        f"around the timed steps); {mfu_line(m)}",
    ]
    return "\n".join(lines)


def mfu_line(m: dict[str, Any]) -> str:
    """``model FLOP utilisation: X%``, or why there is no figure (the model outran the probe)."""
    if m["mfu"] is not None:
        return f"model FLOP utilisation: {m['mfu']:.1%}"
    return (f"model FLOP utilisation: not reported: the model ran at {m['model_flops_per_s'] / 1e9:.1f} GFLOP/s, "
            f"above the best matmul the peak probe timed ({m['matmul_peak_flops'] / 1e9:.1f} GFLOP/s), so the "
            "peak probe is unreliable on this device now (shared or throttling; rerun on an idle device)")
