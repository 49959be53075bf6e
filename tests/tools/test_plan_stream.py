"""tools/plan_stream.py: the epoch plan of a cluster from sizes.json alone (no shard needed)."""

from __future__ import annotations

import json
import re

from .test_make_shards import _run


def test_plan_stream_prints_the_plan_without_reading_shards(tmp_path, capsys):
    sizes = {f"{i:05d}.tar": 100 + i % 7 for i in range(60)}  # 6,174 samples; no tar file exists
    (tmp_path / "sizes.json").write_text(json.dumps(sizes))
    total = sum(sizes.values())
    assert _run("plan_stream.py", "--data", f"{tmp_path}/{{00000..00059}}.tar", "--nodes", "2", "--devices", "2",
                "--num-workers", "3", "--batch-size", "16", "--epochs", "3") == 0
    out = capsys.readouterr().out
    rank_batches = total // (4 * 16)
    assert f"{total:,} samples" in out and "12 slots" in out
    low, high = rank_batches // 3, -(-rank_batches // 3)
    assert re.search(rf"batches per rank:\s+{rank_batches} per epoch \({low}-{high} per worker\)", out)
    assert f"{4 * 16 * rank_batches:,} read, {total - 4 * 16 * rank_batches:,} left out" in out
    assert re.search(r"duplicates:\s+0, 0, 0 \(epoch 0, 1, 2\)", out)
    assert len(re.findall(r"mixing \d -> \d: +\d+\.\d% of shards read by other slots", out)) == 2


def test_plan_stream_without_sizes_json_explains(tmp_path, capsys):
    assert _run("plan_stream.py", "--data", f"{tmp_path}/{{00000..00003}}.tar", "--batch-size", "4") == 1
    assert "sizes.json" in capsys.readouterr().err


def test_plan_stream_names_a_malformed_sizes_json(tmp_path, capsys):
    (tmp_path / "sizes.json").write_text('{"00000.tar": -100}')
    assert _run("plan_stream.py", "--data", f"{tmp_path}/00000.tar", "--batch-size", "4") == 1
    assert f"{tmp_path / 'sizes.json'}: every value must be a non-negative integer" in capsys.readouterr().err
    assert _run("plan_stream.py", "--data", f"{tmp_path}/00000.tar", "--batch-size", "4", "--shuffle-buffer", "0") == 2
    assert "--shuffle-buffer must be >= 1" in capsys.readouterr().err
