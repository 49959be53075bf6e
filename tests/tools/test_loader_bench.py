"""benchmarks/loader.py: mmssl's loader and open_clip_train's on the same generated shards."""

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_loader_benchmark_runs_every_tool_on_web_like_shards(tmp_path):
    pytest.importorskip("pandas", reason="open_clip_train 3.3.0 imports pandas (the bench extra)")
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import loader
        from synthetic_shards import write_bench_shards
    finally:
        sys.path.pop(0)
    shards = write_bench_shards(str(tmp_path / "shards"), size=64, count=24, shard_size=12)
    assert loader.main(["--data", shards, "--num-workers", "0", "--batch-size", "4", "--batches", "2",
                        "--warmup", "1", "--output-json", str(tmp_path / "out.json")]) == 0
    result = json.loads((tmp_path / "out.json").read_text())
    assert set(result["median"]) == set(loader.TOOLS)
    for figures in result["median"].values():
        assert figures["images_per_s_per_worker"] > 0 and figures["main_cpu_ms_per_batch"] > 0
    with pytest.raises(SystemExit):
        loader.main(["--shards", shards, "--tools", "mmssl,dali"])  # --shards: the old spelling of --data
