"""The benchmark harness: its figures, its FLOP count, and the open_clip_train peer."""

import json
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.bench import _median_of, benchmark, format_report, with_patch_dropout
from benchmarks.open_clip_peer import open_clip_precision, parse_peer_log, peer_args
from mmssl.data.sources import expand_urls
from mmssl.models.clip import CLIP

REPO = Path(__file__).resolve().parents[2]

# What open_clip_train/train.py logs per step with --log-every-n-steps 1 (batch 8).
PEER_LOG = """\
2026-01-01,00:00:00 | INFO | Train Epoch: 0 [ 8/32 (25%)] Data (t): 0.900 Batch (t): 2.000, 4.00000/s, 4.00000/s/gpu LR: 0.000000 Logit Scale: 14.286 Contrastive_loss: 2.0794 (2.0794) Loss: 2.0794 (2.0794)
2026-01-01,00:00:01 | INFO | Train Epoch: 0 [16/32 (50%)] Data (t): 0.010 Batch (t): 0.100, 80.0000/s, 80.0000/s/gpu LR: 0.000000 Logit Scale: 14.286 Contrastive_loss: 2.0794 (2.0794) Loss: 2.0794 (2.0794)
2026-01-01,00:00:01 | INFO | Train Epoch: 0 [24/32 (75%)] Data (t): 0.020 Batch (t): 0.300, 26.6667/s, 26.6667/s/gpu LR: 0.000000 Logit Scale: 14.286 Contrastive_loss: 2.0794 (2.0794) Loss: 2.0794 (2.0794)
2026-01-01,00:00:01 | INFO | Train Epoch: 0 [32/32 (100%)] Data (t): 0.010 Batch (t): 0.100, 80.0000/s, 80.0000/s/gpu LR: 0.000000 Logit Scale: 14.286 Contrastive_loss: 2.0794 (2.0794) Loss: 2.0794 (2.0794)
"""


def test_parse_peer_log_drops_warmup_and_sums_step_times():
    out = parse_peer_log(PEER_LOG, warmup=1)
    assert out["steps"] == 3
    assert out["samples_per_s"] == pytest.approx(24 / 0.5)  # 3 steps x 8 samples in 0.1+0.3+0.1 s
    assert out["step_time_s"] == pytest.approx(0.1)
    assert out["data_wait_fraction"] == pytest.approx(0.04 / 0.5)
    with pytest.raises(RuntimeError, match="logged 4 steps"):
        parse_peer_log(PEER_LOG, warmup=4)


def test_peer_args_translate_precision_and_patch_dropout():
    args = peer_args("m", ["a.tar", "b.tar"], 64, 8, 2, "bf16-mixed", "/tmp/x", patch_dropout=0.5)
    opts = dict(zip(args[::2], args[1::2]))  # flag-value pairs up to the first bare flag
    assert args[args.index("--train-data") + 1] == "a.tar::b.tar"
    assert args[args.index("--precision") + 1] == "amp_bf16"
    assert args[args.index("--force-patch-dropout") + 1] == "0.5"
    assert "--dataset-resampled" in args and opts["--train-data"] == "a.tar::b.tar"
    assert open_clip_precision("32-true") == "fp32"
    with pytest.raises(ValueError, match="64-true"):
        open_clip_precision("64-true")


def test_with_patch_dropout_copies_config(tmp_path, tiny_clip_json):
    path = with_patch_dropout(tiny_clip_json, 0.5, str(tmp_path))
    cfg = json.loads(Path(path).read_text())
    assert cfg["vision_cfg"]["patch_dropout"] == 0.5
    assert cfg["text_cfg"] == json.loads(Path(tiny_clip_json).read_text())["text_cfg"]
    assert (
        json.loads(Path(with_patch_dropout("ViT-B-32", 0.25, str(tmp_path))).read_text())["vision_cfg"]["width"] == 768
    )
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        with_patch_dropout(tiny_clip_json, 1.0, str(tmp_path))


def test_repeats_report_median_pair_ratio_and_median_runs():
    runs = [
        {"mmssl": {"samples_per_s": s}, "open_clip_train": {"samples_per_s": p}, "ratio": s / p}
        for s, p in ((10.0, 10.0), (30.0, 10.0), (40.0, 20.0))
    ]
    out = _median_of(runs)
    assert out["ratio"] == 2.0 and out["pair_ratios"] == [1.0, 3.0, 2.0]
    assert out["mmssl"]["samples_per_s"] == 30.0 and out["open_clip_train"]["samples_per_s"] == 10.0
    assert _median_of(runs[:2])["ratio"] == 2.0  # even count: mean of the middle two


def _expected_step_flops(model_json: str, batch: int) -> int:
    """FLOPs of one CLIP forward + backward, counted independently of the harness."""
    model = CLIP(model_name=model_json)
    images = torch.randn(batch, 3, 32, 32)
    tokens = torch.randint(0, 49408, (batch, 16))
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        model.contrastive_loss(model(images, tokens)).backward()
    return counter.get_total_flops()


def _common(tiny_demo, tiny_clip_json):
    return [
        f"--model.init_args.model_name={tiny_clip_json}",
        # The shards themselves, not demo_dir: the data module would regenerate a full-size demo
        # set there (its settings differ from the fixture's).
        f"--data.init_args.train_data={tiny_demo.train}",
        "--data.init_args.batch_size=8", "--data.init_args.num_workers=0",
    ]


def test_benchmark_measures_lightning_steps_and_counts_their_flops(tiny_demo, tiny_clip_json, tmp_path):
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import benchmark as tool
    finally:
        sys.path.pop(0)
    out_json = tmp_path / "bench.json"
    assert tool.main([
        "--config", str(REPO / "configs/demo/clip.yaml"), "--warmup", "2", "--steps", "3",
        "--output-json", str(out_json), "--", *_common(tiny_demo, tiny_clip_json),
    ]) == 0
    result = json.loads(out_json.read_text())
    m = result["mmssl"]
    assert m["steps"] == 3 and m["batch_size"] == 8 and m["precision"] == "32-true"
    assert m["samples_per_s"] > 0 and m["step_time_s"] > 0
    assert 0.0 <= m["data_wait_fraction"] < 1.0
    assert m["peak_memory_bytes"] > 50 * 2**20  # a Python process with torch loaded
    # The timer counts exactly one forward + backward of the real step (optimizer: no matmuls).
    assert m["flops_per_step"] == _expected_step_flops(tiny_clip_json, 8)
    # The peak is the best probe repeat right before and after the timed steps: never below what
    # the model reached, else no figure (tests/tools/test_peak_probe.py).
    assert len(m["peak_probes"]) == 2 and m["matmul_peak_flops"] == max(m["peak_probes"])
    assert m["mfu"] is None or 0.0 < m["mfu"] <= 1.0
    assert m["shards"] == expand_urls(tiny_demo.train)  # what the peer is handed


def test_compare_open_clip_runs_the_peer_on_the_same_shards(tiny_demo, tiny_clip_json, capsys):
    pytest.importorskip("pandas", reason="open_clip_train 3.3.0 imports pandas (the bench extra)")
    result = benchmark(
        str(REPO / "configs/demo/clip.yaml"), _common(tiny_demo, tiny_clip_json), warmup=1, steps=2,
        compare_open_clip=True, patch_dropout=0.5,
    )
    peer = result["open_clip_train"]
    # It ran past the end of a 16-sample shard: the webdataset end-of-shard fix holds.
    assert peer["steps"] == 2 and peer["samples_per_s"] > 0
    assert "--force-patch-dropout" not in peer["command"]  # dropout comes in the model config
    assert "clip_test_tiny_pd50" in peer["command"] and "--precision fp32" in peer["command"]
    assert result["ratio"] == pytest.approx(result["mmssl"]["samples_per_s"] / peer["samples_per_s"])
    assert "ratio mmssl / open_clip_train" in format_report(result)


def _mae_args(tiny_demo):
    return [f"--data.init_args.train_data={tiny_demo.train}", "--data.init_args.batch_size=8",
            "--data.init_args.num_workers=0", "--model.init_args.embed_dim=32", "--model.init_args.depth=2",
            "--model.init_args.decoder_embed_dim=32", "--model.init_args.decoder_depth=1"]


def test_lightly_peer_has_the_configs_sizes():
    pytest.importorskip("lightly", reason="lightly is in the bench extra")
    from benchmarks.lightly_peer import lightly_mae
    from mmssl.models.mae import MAE

    mine = MAE(image_size=32, patch_size=4, embed_dim=64, depth=3, num_heads=4, decoder_embed_dim=32,
               decoder_depth=2, decoder_num_heads=4)
    peer = lightly_mae(mine.hparams)
    def count(module):  # lightly's backbone also holds a mask token MAE's encoder never uses
        return sum(p.numel() for n, p in module.named_parameters() if p.requires_grad and "mask_token" not in n)

    # Same encoder to the parameter (timm blocks, patch embed, cls token; fixed sin-cos positions).
    assert count(peer.backbone) == count(mine.encoder)
    loss = peer(torch.randn(2, 3, 32, 32))
    loss.backward()
    assert loss.ndim == 0 and torch.isfinite(loss)


def test_compare_lightly_and_mask_ratio_speed_up_report(tiny_demo):
    pytest.importorskip("lightly", reason="lightly is in the bench extra")
    config = str(REPO / "configs/demo/mae.yaml")
    result = benchmark(config, _mae_args(tiny_demo), warmup=1, steps=2, compare_lightly=True)
    assert result["lightly"]["steps"] == 2 and result["lightly"]["samples_per_s"] > 0
    assert result["ratio"] == pytest.approx(result["mmssl"]["samples_per_s"] / result["lightly"]["samples_per_s"])
    assert "ratio mmssl / lightly" in format_report(result)
    # Mask 0.75 against 0.25: the FLOP ratio of the two runs, measured, is above 1.
    result = benchmark(config, _mae_args(tiny_demo), warmup=1, steps=2, compare_mask_ratio=0.25)
    assert result["mmssl_mask_ratio"]["mask_ratio"] == 0.25
    assert 1.2 < result["flop_ratio"] < 3.0
    assert "FLOP ratio" in format_report(result)
    with pytest.raises(ValueError, match="choose one"):
        benchmark(config, _mae_args(tiny_demo), warmup=1, steps=1, compare_lightly=True, compare_mask_ratio=0.1)


def test_bf16_warning_only_when_measured_slower(monkeypatch):
    from benchmarks import bench

    assert bench.bf16_advice(100e9, 2.5e9).startswith("WARNING: bf16 matmuls run 40.0x slower")
    assert "32-true" in bench.bf16_advice(100e9, 2.5e9)
    assert bench.bf16_advice(100e9, 400e9) is None  # an AMX CPU
    peaks = {"32-true": 100e9, "bf16-mixed": 2e9}
    monkeypatch.setattr(bench, "matmul_peak_flops", lambda device, precision, size=None, repeats=3: peaks[precision])
    run = {"device_type": "cpu", "precision": "bf16-mixed"}
    assert "50.0x slower" in bench.cpu_bf16_warning({"mmssl": run})
    assert bench.cpu_bf16_warning({"mmssl": {**run, "precision": "32-true"}}) is None
    assert bench.cpu_bf16_warning({"mmssl": {**run, "device_type": "cuda"}}) is None
    peaks["bf16-mixed"] = 300e9
    assert bench.cpu_bf16_warning({"mmssl": run}) is None
