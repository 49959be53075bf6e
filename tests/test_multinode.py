"""A 2-node job without a cluster: torchrun with 2 nodes x 1 process on localhost."""

import json
import sys

from tests.cli_runs import PG_TIMEOUT, REPO, free_port, run_together


def test_torchrun_two_nodes_each_read_their_own_shards(tmp_path, tiny_demo, tiny_clip_json):
    port = free_port()
    commands = [
        [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
            f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}",
            "-m", "mmssl", "fit",
            "--config", str(REPO / "configs/demo/clip.yaml"),
            "--config", str(REPO / "configs/trainer/ddp_cpu.yaml"),
            "--trainer.num_nodes=2", "--trainer.devices=1",
            f"--model.init_args.model_name={tiny_clip_json}",
            f"--data.init_args.demo_dir={tiny_demo.root}", "--data.init_args.batch_size=4",
            "--data.init_args.num_workers=0", "--trainer.max_epochs=1", "--trainer.limit_train_batches=2",
            PG_TIMEOUT,  # validation on: the held-out split is dealt over the two nodes
            f"--trainer.default_root_dir={tmp_path / 'runs'}", "--trainer.enable_progress_bar=false",
            "--trainer.callbacks+=helpers.DumpShards", f"--trainer.callbacks.folder={tmp_path / 'shards'}",
        ]
        for node in (0, 1)
    ]
    done = run_together(commands, 300, cwd=tmp_path)  # a hang fails here, not in CI; output through files
    for code, out in done:
        assert code == 0, out[-3000:]
    assert "val/loss" in open(tmp_path / "runs" / "version_0" / "metrics.csv").readline()
    ranks = [json.loads((tmp_path / "shards" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["node_rank"] for r in ranks] == [0, 1]
    assert all(r["world_size"] == 2 and r["environment"] == "TorchElasticEnvironment" for r in ranks)
    node0, node1 = set(ranks[0]["shards"]), set(ranks[1]["shards"])
    assert node0 and node1 and not node0 & node1  # each node reads its own part...
    assert len(node0 | node1) == 4  # ...and together they read every training shard
