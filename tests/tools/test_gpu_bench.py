"""benchmarks/gpu.sh --dry-run: the GPU benchmark's wiring (shards, both recipes) on CPU.

The open_clip_train peer is left out here (``--skip-open-clip``: its own process would double the
test's time); tests/tools/test_benchmark.py runs the same peer code on a tiny CLIP.
"""

import json
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gpu_benchmark_dry_run_runs_both_recipes(tmp_path):
    proc = subprocess.run(
        ["bash", str(REPO / "benchmarks/gpu.sh"), "--dry-run", "--skip-open-clip", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "== MAE ViT-B/16, mask 0.75, 32-true, batch 2 ==" in out and "== CLIP ViT-B/32, 32-true, batch 2 ==" in out
    assert out.count("model FLOP utilisation") == 2 and "open_clip_train" not in out
    results = json.loads((tmp_path / "results.json").read_text())
    mae, clip = results["MAE ViT-B/16, mask 0.75"], results["CLIP ViT-B/32"]
    # 2 steps each: 1 warm-up (FLOP-counted) + 1 timed, on the recipes' real models.
    assert mae["mmssl"]["steps"] == 1 and clip["mmssl"]["steps"] == 1
    assert mae["mmssl"]["config"] == "configs/mae/vit_base_patch16.yaml" and mae["mmssl"]["batch_size"] == 2
    # ViT-B/16 MAE at mask 0.75 and ViT-B/32 CLIP, forward + backward of 2 samples: tens of GFLOPs.
    assert 30e9 < mae["mmssl"]["flops_per_step"] < 300e9 and 20e9 < clip["mmssl"]["flops_per_step"] < 200e9
    assert (
        clip["mmssl"]["shards"] == clip["runs"][0]["mmssl"]["shards"] and (tmp_path / "shards256/sizes.json").exists()
    )
